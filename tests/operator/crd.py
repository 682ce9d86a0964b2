"""The CRD as the API server applies it, modelled for the in-memory test API: structural defaults,
openAPIV3Schema validation (jsonschema), CEL rules (cel-python).

Test-only: the in-memory API (`fakeapi`) and fast tests use it; tests/k8s/test_crd_cel.py compares
its verdicts with a real kube-apiserver's on every CEL rule, and the real server is right.
jsonschema and cel-python are test dependencies and are imported only where used.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

CRD_DIR = Path(__file__).resolve().parents[2] / "deploy" / "crds"
CRD_PATH = CRD_DIR / "inferplane.io_inferencedeployments.yaml"


@cache
def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def version_schema(crd: Mapping[str, Any] | None = None, version: str = "v1alpha1") -> dict[str, Any]:
    crd = crd or load_crd()
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(version)


def to_json_schema(node: Any) -> Any:
    """Translate a Kubernetes structural schema to JSON Schema (draft 2020-12) for jsonschema."""
    if isinstance(node, list):
        return [to_json_schema(item) for item in node]
    if not isinstance(node, Mapping):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("x-kubernetes-validations", "default", "x-kubernetes-list-type", "x-kubernetes-list-map-keys"):
            continue
        if key == "x-kubernetes-int-or-string":
            continue
        if key == "x-kubernetes-preserve-unknown-fields":
            continue
        out[key] = to_json_schema(value) if key in ("properties", "items", "additionalProperties") else value
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
    if node.get("x-kubernetes-int-or-string"):
        pattern = out.pop("pattern", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string", **({"pattern": pattern} if pattern else {})}]
    if out.get("type") == "object" and "properties" in out and not node.get("x-kubernetes-preserve-unknown-fields"):
        # The API server prunes unknown fields; we reject them so that a typo fails loudly in tests.
        out.setdefault("additionalProperties", False)
    return out


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Structural defaulting: fill `default`s of absent properties, recursively, as the API server does."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def _cel_rules(schema: Mapping[str, Any], value: Any, path: str) -> Iterator[tuple[str, Mapping[str, Any], Any]]:
    """Every CEL rule with the value it applies to; rules of absent optional fields do not run."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule, value
    if isinstance(value, Mapping):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                yield from _cel_rules(sub, value[name], f"{path}.{name}")


@cache
def _cel_program(rule: str) -> Any:
    """Compiling CEL is slow (a parser per rule); each rule compiles once per process."""
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(schema: Mapping[str, Any], obj: Mapping[str, Any]) -> list[str]:
    import celpy

    errors = []
    for path, rule, value in _cel_rules(schema, obj, ""):
        program = _cel_program(rule["rule"])
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception) or not bool(result):
            where = (path + rule.get("fieldPath", "")).lstrip(".")
            errors.append(f"{where}: {rule.get('message') or 'failed rule: ' + rule['rule']}")
    return errors


@cache
def _validator(path: Path = CRD_PATH) -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(to_json_schema(version_schema(load_crd(path))))


def validate(obj: Mapping[str, Any], path: Path = CRD_PATH) -> tuple[dict[str, Any], list[str]]:
    """Default and validate a custom resource against the CRD at `path`; returns (defaulted object, errors)."""
    schema = version_schema(load_crd(path))
    defaulted = apply_defaults(schema, copy.deepcopy(dict(obj)))
    validator = _validator(path)
    errors = [
        f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in sorted(validator.iter_errors(defaulted), key=lambda e: list(map(str, e.absolute_path)))
    ]
    if not errors:  # like the API server, CEL runs only on schema-valid objects
        errors = cel_errors(schema, defaulted)
    return defaulted, errors
