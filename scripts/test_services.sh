#!/usr/bin/env bash
# Installs (Debian packages) and starts the servers the test suite talks to, on loopback only:
#   PostgreSQL 127.0.0.1:5432, user postgres, trust auth, database `test`  (INFERPLANE_TEST_PG_URL)
#   Redis      127.0.0.1:6379                                               (INFERPLANE_TEST_REDIS_URL)
#   etcd       the binary only: the Kubernetes tests start their own etcd per run
#   promtool   (Debian's prometheus package) the metrics lint the tests run
#   alertmanager  (Debian's prometheus-alertmanager, /usr/bin/prometheus-alertmanager) the binary only:
#              the alert routing test starts its own on loopback
#   the node's tools  runc, the CNI plugins, iptables, conntrack (the one-node cluster, tests/cluster),
#              debootstrap and buildah (the offline image build, deploy/image): binaries only
#   chromium   the browser the console tests drive headless (tests/console, through Playwright)
# Nothing starts these for us on the project's machines. Safe to run again: what already runs is kept.
# Needs root (apt-get, pg_ctlcluster); CI runs as root.
set -euo pipefail

packages=()
command -v pg_ctlcluster >/dev/null 2>&1 || packages+=(postgresql)
command -v redis-server >/dev/null 2>&1 || packages+=(redis-server)
command -v etcd >/dev/null 2>&1 || packages+=(etcd-server)
command -v promtool >/dev/null 2>&1 || packages+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || command -v alertmanager >/dev/null 2>&1 ||
  packages+=(prometheus-alertmanager)
command -v runc >/dev/null 2>&1 || packages+=(runc)
[ -x /usr/lib/cni/bridge ] || packages+=(containernetworking-plugins)
command -v iptables >/dev/null 2>&1 || packages+=(iptables)
command -v conntrack >/dev/null 2>&1 || packages+=(conntrack)
command -v debootstrap >/dev/null 2>&1 || packages+=(debootstrap)
command -v buildah >/dev/null 2>&1 || packages+=(buildah)
command -v chromium >/dev/null 2>&1 || packages+=(chromium)
if [ ${#packages[@]} -gt 0 ]; then
  echo "test services: installing ${packages[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null
fi

# PostgreSQL: the Debian cluster, listening on loopback, trusting loopback connections.
version=$(ls /usr/lib/postgresql | sort -n | tail -1)
if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main"' | grep -q .; then
  pg_createcluster "$version" main >/dev/null
fi
conf=/etc/postgresql/$version/main
if ! grep -q '^# inferplane tests' "$conf/pg_hba.conf"; then
  # Prepended: the first matching line wins, and Debian's default asks loopback for a password.
  printf '# inferplane tests: loopback trusted\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n' |
    cat - "$conf/pg_hba.conf" > "$conf/pg_hba.conf.new"
  mv "$conf/pg_hba.conf.new" "$conf/pg_hba.conf"
  chown postgres:postgres "$conf/pg_hba.conf"
fi
if pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" && $4 == "online"' | grep -q .; then
  pg_ctlcluster "$version" main reload
else
  pg_ctlcluster "$version" main start
fi
for _ in $(seq 1 30); do
  pg_isready -q -h 127.0.0.1 -p 5432 && break
  sleep 1
done
pg_isready -h 127.0.0.1 -p 5432
if ! psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1; then
  psql -h 127.0.0.1 -U postgres -qc 'CREATE DATABASE test'
fi

# Redis: a loopback-only server, no persistence (test data only).
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --bind 127.0.0.1 --port 6379 --save '' --appendonly no --daemonize yes \
    --logfile /tmp/inferplane-test-redis.log
  for _ in $(seq 1 30); do
    redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break
    sleep 0.5
  done
fi
echo "test services: PostgreSQL $(psql -h 127.0.0.1 -U postgres -tAc 'SHOW server_version'), Redis $(redis-cli -h 127.0.0.1 -p 6379 ping), $(etcd --version | head -1)"
