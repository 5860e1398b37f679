"""Upgrades: chart version discipline, and the CRD upgrade path.

- `Chart.yaml`'s appVersion is the package's version (pyproject.toml, vllmfit.__version__), the
  chart's version is SemVer, and CHANGELOG.md has a section for it (Keep a Changelog).
- helm never upgrades a CRD in crds/ (docs/operations.md: `kubectl apply --server-side` first).
  Objects the API server stored under an older CRD must still validate under the new one: the
  API server validates every later write of them against the new schema, status writes and the
  metadata-only patch that removes a finalizer included, so a tightened field would leave them
  stuck. The older CRD is taken from git history into tests/data/upgrade/ (the first CRD vllmfit
  shipped, commit c1b2c81, with the examples of that commit); objects are built from it: every
  field of its spec and status at its bounds, each enum value, each default.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml

from vllmfit import __version__

from .conftest import CHART, ROOT, load_docs

DATA = ROOT / "tests" / "data" / "upgrade"
OLD_COMMIT = "c1b2c81"
CRD = ROOT / "crds" / "vllmdeployments.vllmfit.dev.yaml"
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")


def test_app_version_is_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"] == __version__
    assert SEMVER.match(chart["version"]), chart["version"]


def test_the_changelog_has_the_chart_and_app_versions() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog") and "keepachangelog.com" in text
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert chart["appVersion"] in headings, f"CHANGELOG.md has no section for {chart['appVersion']}"
    assert f"chart {chart['version']}" in text


def test_the_image_tag_defaults_to_the_app_version(render: Any) -> None:
    op = next(d for d in render() if d["kind"] == "Deployment")
    image = op["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.endswith(":" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


# --- the CRD upgrade path ------------------------------------------------------------------------


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    [version] = [v for v in crd["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """As the API server applies it under strict field validation (tests/test_crd.py's rule)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            if node.get("x-kubernetes-list-type") == "set":
                node["uniqueItems"] = True
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


def values_of(node: dict[str, Any]) -> list[Any]:
    """Values a field of this schema node accepts, at its edges."""
    if "enum" in node:
        return list(node["enum"])
    out = [node["default"]] if "default" in node else []
    kind = node.get("type")
    if kind in ("integer", "number"):
        step = 1 if kind == "integer" else 1e-6
        if "minimum" in node:
            out.append(node["minimum"] + (step if node.get("exclusiveMinimum") else 0))
        if "maximum" in node:
            out.append(node["maximum"] - (step if node.get("exclusiveMaximum") else 0))
        out = out or [1]
    elif kind == "string":
        out.append("a" * max(node.get("minLength", 1), 1))
        if "maxLength" in node:
            out.append("a" * node["maxLength"])
    elif kind == "boolean":
        out += [True, False]
    return out


def leaves(node: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    if node.get("type") == "object" and "properties" in node:
        for name, sub in node["properties"].items():
            yield from leaves(sub, (*path, name))
    elif path:
        yield path, node


def set_at(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    cur = obj
    for key in path[:-1]:
        cur = cur.setdefault(key, {})
    cur[path[-1]] = value
    return obj


def stored_objects() -> list[tuple[str, dict[str, Any]]]:
    """What the old CRD let the API server store: the old examples, and one object per old field
    value (spec and status), each valid under the old schema."""
    old = _schema(yaml.safe_load((DATA / f"vllmdeployments-{OLD_COMMIT}.yaml").read_text()))
    valid = jsonschema.Draft4Validator(_closed(old))
    base = {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment",
            "metadata": {"name": "stored", "namespace": "ml"}, "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct"}}
    out = []
    for f in sorted(DATA.glob(f"*-{OLD_COMMIT}.yaml")):
        out += [(f.name, d) for d in load_docs(f.read_text()) if d.get("kind") == "VLLMDeployment"]
    for top in ("spec", "status"):
        for path, node in leaves(old["properties"][top], (top,)):
            if node.get("type") == "array":
                item = node.get("items") or {}
                samples: list[Any] = [[v] for v in values_of(item)] if item.get("type") != "object" else []
            else:
                samples = values_of(node)
            for v in samples:
                obj = set_at(base, path, v)
                if not list(valid.iter_errors(obj)):
                    out.append((f"{'.'.join(path)}={json.dumps(v)[:40]}", obj))
    return out


STORED = stored_objects()
NEW = jsonschema.Draft4Validator(_closed(_schema(yaml.safe_load(CRD.read_text()))))


def test_the_old_crd_is_the_one_in_git_history() -> None:
    import subprocess

    proc = subprocess.run(["git", "show", f"{OLD_COMMIT}:crds/vllmdeployments.vllmfit.dev.yaml"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"no git history here ({proc.stderr.strip()[:80]})")
    assert proc.stdout == (DATA / f"vllmdeployments-{OLD_COMMIT}.yaml").read_text()


def test_there_are_stored_objects_of_every_kind() -> None:
    names = [n for n, _ in STORED]
    assert len(STORED) > 60
    assert any(n.startswith("llama-8b") for n in names) and any(n.startswith("status.phase") for n in names)
    assert any(n.startswith("spec.placement.") for n in names)


@pytest.mark.parametrize(("name", "obj"), STORED, ids=[n for n, _ in STORED])
def test_objects_stored_under_the_old_crd_validate_under_the_new_one(name: str, obj: dict[str, Any]) -> None:
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in NEW.iter_errors(obj)]
    assert not errors, f"{name} was valid under the {OLD_COMMIT} CRD, not under the new one: {errors}"


def test_the_check_can_fail() -> None:
    """A field tightened since (replicas at most 5, say) is caught."""
    tight = copy.deepcopy(_schema(yaml.safe_load(CRD.read_text())))
    tight["properties"]["spec"]["properties"]["replicas"]["maximum"] = 5
    refused = [n for n, o in STORED if list(jsonschema.Draft4Validator(_closed(tight)).iter_errors(o))]
    assert any(n.startswith("spec.replicas=") for n in refused)


def test_the_chart_ships_the_crd_it_documents_applying_first() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    assert "kubectl apply --server-side" in text and "charts/vllmfit/crds/" in text
    assert (CHART / "crds" / CRD.name).read_text() == CRD.read_text()
