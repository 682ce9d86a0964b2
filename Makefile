# Two commands do all the set-up on a fresh machine: `make up` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install up test test-fast test-k8s test-cluster cluster cluster-down images services envtest lint proto crds monitoring bench bench-operator clean

$(STAMP): pyproject.toml Makefile scripts/install.sh
	@PYTHON=$(PYTHON) scripts/install.sh
	@touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/inferplane up

test: install services envtest
	$(PY) -m ruff check inferplane tests
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m 'not slow'

# The operator against a real kube-apiserver + etcd + kube-controller-manager (also part of `make test`).
test-k8s: install services envtest
	$(PY) -m pytest -q tests/k8s

# PostgreSQL, Redis and etcd on loopback (Debian packages; needs root). Without root the tests that
# need them skip and say why (under CI they fail).
services:
	@if [ "$$(id -u)" = 0 ]; then bash scripts/test_services.sh; \
	else echo "services: not root, so PostgreSQL/Redis/etcd are not installed or started (sudo bash scripts/test_services.sh)"; fi

# kube-apiserver and kube-controller-manager built from Go modules into ~/.cache/inferplane/envtest
# (tens of minutes the first time, reused after). Under CI a failed build fails; elsewhere the
# Kubernetes tests then skip and say why.
envtest:
	@tests/k8s/envtest/build.sh >/dev/null || { [ -z "$$CI" ] && echo "envtest: not built; tests/k8s will skip"; }

# The offline image build (deploy/image/build.py): debootstrap + buildah, cached by the hash of
# what goes in; prints the archives and their sizes. Needs root.
images: install
	$(PY) deploy/image/build.py

# A real one-node cluster (kubelet, containerd, runc, kube-proxy, CoreDNS in a network namespace of
# its own) running the images above; prints how to point kubectl and helm at it. Needs root and Go.
cluster: install services envtest
	@tests/cluster/build.sh >/dev/null
	$(PY) -m tests.cluster.node up

cluster-down:
	$(PY) -m tests.cluster.node down

# The chart on that node (also part of `make test`).
test-cluster: install services envtest
	$(PY) -m pytest -q tests/cluster

lint: install
	$(PY) -m ruff check inferplane tests

# The CRD is generated from inferplane/api/deployment.py; a test fails when a committed copy is stale.
crds: install
	$(VENV)/bin/inferplane crd --write deploy/crds helm/inferplane/crds

monitoring: install
	$(VENV)/bin/inferplane monitoring render --write deploy/monitoring helm/inferplane/monitoring

proto: install
	PY=$(PY) scripts/gen_proto.sh

bench: install
	$(VENV)/bin/inferplane bench engine

# The operator settling 200 InferenceDeployments on the loopback kube-apiserver the tests use.
bench-operator: install services envtest
	$(PY) scripts/bench_operator_envtest.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
