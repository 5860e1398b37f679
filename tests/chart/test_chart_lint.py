"""`helm lint --strict`, `helm install --dry-run=client` (NOTES.txt) and values.schema.json."""

from __future__ import annotations

import json

import pytest
import yaml

from .conftest import CHART, NAMESPACE, RELEASE, VALUE_SETS, values_args


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(helm, value_set):
    out = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values_args(value_set)).stdout
    assert "0 chart(s) failed" in out


def test_install_dry_run_prints_next_steps(helm):
    out = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client").stdout
    notes = out.split("NOTES:", 1)[1]
    for needle in (
        "kubectl get vllmd",
        "kind: VLLMDeployment",
        "vllmfit-validate",
        "caBundle",
        "endpointslices",
    ):
        assert needle in notes, needle


def test_install_dry_run_notes_with_cert_manager(helm):
    out = helm(
        "install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", *values_args("cert-manager")
    ).stdout
    assert "get certificate vllmfit-webhook" in out.split("NOTES:", 1)[1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "operator.replicas=0"], "minimum"),
        (["--set", "operator.replicas=3", "--set", "operator.peering.enabled=false"], "must be true"),
        (["--set", "operator.replicaz=2"], "additional properties"),
        (["--set", "unknownTopLevel=1"], "additional properties"),
        (["--set", "webhook.failurePolicy=Sometimes"], "failurePolicy"),
        (["--set", "webhook.timeoutSeconds=31"], "timeoutSeconds"),
        (["--set", "operator.resources.limits.memory=lots"], "memory"),
        (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
        (["--set", "agent.runtimeClassName=Not_A_Name"], "runtimeClassName"),
        (["--set", "certManager.issuerRef.kind=Vault"], "kind"),
        (["--set-string", "operator.replicas=2"], "replicas"),
        (["--set-json", "budget.utilization=1.5"], "utilization"),  # the budget policy: in [0, 1]
        (["--set-json", "budget.utilization=-0.1"], "utilization"),
        (["--set", "budget.reserve=lots"], "reserve"),  # a Kubernetes quantity
        (["--set", "kvCache.defaultGrant=all"], "defaultGrant"),  # the default KV grant: requests or room
        (["--set", "kvCache.defaultRequests=0"], "defaultRequests"),
    ],
)
def test_values_schema_rejects(helm, args, message):
    proc = helm("template", RELEASE, str(CHART), *args, check=False)
    assert proc.returncode != 0, f"accepted {args}"
    assert "schema" in proc.stderr and message in proc.stderr, proc.stderr


def _leaf_paths(values, prefix=()):
    """Every key path of values.yaml, stopping at free-form maps/lists (pod labels, tolerations...)."""
    for key, value in values.items():
        path = (*prefix, key)
        yield path
        if isinstance(value, dict) and value:
            yield from _leaf_paths(value, path)


def _schema_at(schema, path):
    node = schema
    for key in path:
        props = node.get("properties", {})
        if key in props:
            node = props[key]
        elif isinstance(node.get("additionalProperties"), dict):  # a map of K8s values
            return node["additionalProperties"]
        else:
            return None
    return node


def test_schema_covers_every_value():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [".".join(p) for p in _leaf_paths(values) if _schema_at(schema, p) is None]
    assert not missing, f"values without a schema: {missing}"


def test_schema_closes_every_level():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    open_levels = []
    for path in [(), *_leaf_paths(values)]:
        node = _schema_at(schema, path)
        value = values
        for key in path:
            value = value[key]
        # every object level of *our* values is closed; K8s pass-through objects (resources maps,
        # label maps, affinity, label selectors) are typed by their own schema below that level.
        if (
            isinstance(value, dict)
            and node is not None
            and "properties" in node
            and node.get("additionalProperties") is not False
        ):
            open_levels.append(".".join(path) or "<root>")
    assert not open_levels, f"schema levels without additionalProperties: false: {open_levels}"


def test_every_schema_node_is_described():
    schema = json.loads((CHART / "values.schema.json").read_text())
    undocumented = []

    def walk(node, path):
        for key, sub in node.get("properties", {}).items():
            if "description" not in sub:
                undocumented.append(".".join((*path, key)))
            walk(sub, (*path, key))

    walk(schema, ())
    assert not undocumented, undocumented


def test_kube_version_floor(helm):
    """Chart.yaml kubeVersion >=1.29: the CRD's CEL rules are GA there."""
    helm("template", RELEASE, str(CHART), "--kube-version", "1.29.0")
    proc = helm("template", RELEASE, str(CHART), "--kube-version", "1.28.9", check=False)
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr, proc.stderr
