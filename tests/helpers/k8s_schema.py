"""Validate a custom resource the way the API server would, offline: the CRD's structural schema
(unknown fields rejected), its defaults applied, then its CEL rules (``x-kubernetes-validations``).

The order matters: the API server defaults before it evaluates CEL, and HTTPRoute's rules read
defaulted fields (``has(self.path)`` on a match that names no path), so validating without the
defaulting step rejects valid objects.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

REPO = Path(__file__).resolve().parents[2]
CRD_FILES = {
    (
        "inference.networking.k8s.io",
        "InferencePool",
    ): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
    ("llm-d.ai", "InferenceModelRewrite"): "llm-d.ai_inferencemodelrewrites.yaml",
    ("llm-d.ai", "InferenceObjective"): "llm-d.ai_inferenceobjectives.yaml",
}


def crd_dir() -> Path | None:
    """``$EPP_CRD_DIR``, else the nearest ``shared/k8s`` beside the repository or one of its
    parents (``../shared/k8s`` from the main checkout, ``../../shared/k8s`` from a worktree);
    None when there is none.

    The CRDs are upstream test data and are deliberately not copied into this repository.
    """
    if "EPP_CRD_DIR" in os.environ:
        return Path(os.environ["EPP_CRD_DIR"])
    for parent in REPO.parents:
        if (parent / "shared" / "k8s").is_dir():
            return parent / "shared" / "k8s"
    return None


def crd_path(group: str, kind: str) -> Path:
    """The CRD file for ``group``/``kind``; skips the calling test when it is absent.

    This project's CI provides the CRDs as ``shared/k8s`` beside the clone, so under ``CI=true``
    the skip is reported as a failure (tests/helpers/ci_strict.py): a broken CI image cannot hide
    behind a green run. Elsewhere (a fresh clone with nothing beside it) the test skips and says
    how to provide the files.
    """
    name = CRD_FILES[(group, kind)]
    directory = crd_dir()
    path = directory / name if directory else None
    if path is None or not path.is_file():
        where = f"{directory}" if directory else f"a shared/k8s directory beside {REPO}"
        pytest.skip(
            f"CRD {name} not found in {where}: set EPP_CRD_DIR to a directory holding "
            f"{', '.join(CRD_FILES.values())} (upstream Gateway API and Inference Extension "
            "CRDs; this project's CI provides them as ../shared/k8s)"
        )
    return path


@cache
def _version_schema(group: str, kind: str, version: str) -> dict[str, Any]:
    path = crd_path(group, kind)
    crd = yaml.safe_load(path.read_text())
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return dict(entry["schema"]["openAPIV3Schema"])
    raise KeyError(f"{path} has no version {version}")


def _structural(schema: dict[str, Any], top: bool = True) -> dict[str, Any]:
    """The OpenAPI schema as JSON Schema that rejects unknown fields, as a structural schema
    prunes or (with strict field validation) rejects them."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema:
        out["properties"] = {
            # metadata is validated by the API server itself, not by the CRD's schema.
            k: (v if top and k == "metadata" else _structural(v, False))
            for k, v in schema["properties"].items()
        }
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _structural(schema["additionalProperties"], False)
    if "items" in schema:
        out["items"] = _structural(schema["items"], False)
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's defaults filled in, recursively (also inside defaults)."""
    if isinstance(value, dict):
        value = dict(value)
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            known = schema.get("properties", {})
            for key in value:
                if key not in known:
                    value[key] = apply_defaults(extra, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def _rules(
    schema: dict[str, Any], value: Any, path: str
) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """Every (path, rule, self) the API server would evaluate for ``value``."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, value
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                yield from _rules(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            yield from _rules(schema["items"], item, f"{path}[{i}]")


def validate(obj: dict[str, Any], *, defaults: bool = True) -> list[str]:
    """Every problem with ``obj`` (empty when the API server would accept it).

    ``defaults=False`` skips the defaulting step, only to show that it matters.
    """
    group, _, version = obj["apiVersion"].rpartition("/")
    schema = _version_schema(group, obj["kind"], version)
    errors = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in jsonschema.Draft202012Validator(_structural(schema)).iter_errors(obj)
    ]
    if errors:
        return errors
    defaulted = apply_defaults(schema, obj) if defaults else obj
    env = celpy.Environment()
    for path, rule, value in _rules(schema, defaulted, ""):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: only checked on update, against the stored object
        program = env.program(env.compile(rule["rule"]))
        message = f"{path or '<root>'}: {rule.get('message', rule['rule'])}"
        try:
            result = program.evaluate({"self": json_to_cel(value)})
        except CELEvalError as exc:  # e.g. a field the rule reads is absent
            errors.append(f"{message} (rule failed to evaluate: {exc.args[0]})")
            continue
        if isinstance(result, CELEvalError) or not result:
            errors.append(message)
    return errors
