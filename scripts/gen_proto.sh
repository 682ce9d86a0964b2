#!/usr/bin/env bash
# Regenerates the Python stubs in inferplane/v1/ from proto/ (the stubs are committed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
$PY -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/inferplane/v1/*.proto
touch inferplane/v1/__init__.py
