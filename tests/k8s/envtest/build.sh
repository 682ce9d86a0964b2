#!/usr/bin/env bash
# Builds the Kubernetes binaries from the Go modules pinned in go.mod (beside this script) into a
# cache, once; later runs reuse them. Prints the folder on its last line.
#
#   ${INFERPLANE_ENVTEST_DIR:-~/.cache/inferplane/envtest}/v<version>/{kube-apiserver,kube-controller-manager,
#                                                                       kube-scheduler,kube-proxy,kubelet}
#
# The API server and controller-manager serve tests/k8s; all five make the one-node cluster of
# tests/cluster (`make cluster`). The first build takes about 9 minutes on 2 cores (Go's build
# cache makes a rebuild take a minute or two); the time is printed. Without Go it says so and exits 1.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$here/go.mod")
[ -n "$version" ] || { echo "envtest: go.mod does not require k8s.io/kubernetes" >&2; exit 1; }
cache=${INFERPLANE_ENVTEST_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/inferplane/envtest}
dest=$cache/$version
# The binaries are rebuilt when the pins (go.mod, go.sum) or this script change.
key=$(cat "$here/go.mod" "$here/go.sum" "$0" | sha256sum | cut -c1-16)
binaries=(kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet)

if [ -f "$dest/.key" ] && [ "$(cat "$dest/.key")" = "$key" ]; then
  echo "envtest: reusing Kubernetes $version binaries" >&2
  echo "$dest"
  exit 0
fi
command -v go >/dev/null 2>&1 || { echo "envtest: 'go' is not installed; the Kubernetes tests need it" >&2; exit 1; }

echo "envtest: building ${binaries[*]} $version with $(go version | cut -d' ' -f3) (the first build takes minutes: 9 on 2 cores here)" >&2
start=$(date +%s)
mkdir -p "$cache"
work=$(mktemp -d "$cache/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
# The version is stamped as Kubernetes' own release build does: clients (helm's kubeVersion check,
# kubectl) read it from /version, and an unstamped build reports v0.0.0.
minor=$(echo "$version" | cut -d. -f2)
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  stamp+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
(cd "$here" && GOFLAGS=-buildvcs=false go build -ldflags "-s -w$stamp" -o "$work/" \
  "${binaries[@]/#/k8s.io/kubernetes/cmd/}")
for b in "${binaries[@]}"; do "$work/$b" --version >&2; done
echo "$key" > "$work/.key"
rm -rf "$dest"
mv "$work" "$dest"
trap - EXIT
echo "envtest: built in $(( $(date +%s) - start )) s into $dest" >&2
echo "$dest"
