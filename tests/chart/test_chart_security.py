"""Security objects of the chart (issue 14): the aggregated user roles, and the admission policy
that lets only the agent on a node write that node's GPU inventory. The policy's CEL is evaluated
with cel-python against the requests the API server would send (impersonated userInfo with the
node claim of a bound service-account token)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .conftest import NAMESPACE, find, one

KEY = "vllmfit.dev/gpu-inventory"
AGENT_SA = f"system:serviceaccount:{NAMESPACE}:vllmfit-agent"
NODE_CLAIM = "authentication.kubernetes.io/node-name"


def _rules(role: dict[str, Any]) -> dict[tuple[str, str], tuple[str, ...]]:
    return {(g, r): tuple(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


def test_aggregated_user_roles(render) -> None:
    edit = one(render(), "ClusterRole", "vllmfit-edit")
    view = one(render(), "ClusterRole", "vllmfit-view")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert "rbac.authorization.k8s.io/aggregate-to-view" not in edit["metadata"]["labels"]
    e, v = _rules(edit), _rules(view)
    assert set(e[("vllmfit.dev", "vllmdeployments")]) >= {"create", "update", "patch", "delete"}
    assert e[("vllmfit.dev", "vllmdeployments/status")] == ("get",)  # only the operator writes status
    assert all(set(verbs) <= {"get", "list", "watch"} for verbs in v.values())
    assert not find(render("default", "--set", "rbac.aggregatedRoles=false"), "ClusterRole", "vllmfit-view")


def test_inventory_policy_is_installed_where_the_api_exists(render) -> None:
    assert find(render("default", "--kube-version", "1.35"), "ValidatingAdmissionPolicy")
    assert not find(render("default", "--kube-version", "1.29"), "ValidatingAdmissionPolicy")
    assert not find(render("default", "--set", "agent.inventoryWriterPolicy=false"), "ValidatingAdmissionPolicy",
                    "vllmfit-gpu-inventory")
    binding = one(render(), "ValidatingAdmissionPolicyBinding", "vllmfit-gpu-inventory")
    assert binding["spec"] == {"policyName": "vllmfit-gpu-inventory", "validationActions": ["Deny"]}


# --- The policy's CEL, evaluated ---------------------------------------------------------------


def _node(name: str, inventory: str | None = None, labels: dict[str, str] | None = None,
          **annotations: str) -> dict[str, Any]:
    ann = dict(annotations)
    if inventory is not None:
        ann[KEY] = inventory
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels or {"kubernetes.io/hostname": name}, "annotations": ann},
            "spec": {"podCIDR": "10.0.0.0/24"}}


class Policy:
    def __init__(self, doc: dict[str, Any]) -> None:
        celpy = pytest.importorskip("celpy", reason="cel-python is not installed: CEL not evaluated")
        self.celpy = celpy
        self.env = celpy.Environment()
        self.variables = [(v["name"], self.env.program(self.env.compile(v["expression"])))
                          for v in doc["spec"]["variables"]]
        self.validations = [self.env.program(self.env.compile(v["expression"])) for v in doc["spec"]["validations"]]

    def allows(self, user: str, old: dict[str, Any] | None, new: dict[str, Any], node_claim: str | None = None) -> bool:
        extra = {NODE_CLAIM: [node_claim]} if node_claim else {}
        request = {"userInfo": {"username": user, "extra": extra}, "operation": "UPDATE" if old else "CREATE"}
        act: dict[str, Any] = {"object": self.celpy.json_to_cel(new),
                               "oldObject": self.celpy.json_to_cel(old) if old is not None else None,
                               "request": self.celpy.json_to_cel(request)}
        values: dict[str, Any] = {}
        for name, program in self.variables:
            act["variables"] = self.celpy.json_to_cel({}) if not values else values_map(self.celpy, values)
            values[name] = program.evaluate(act)
        act["variables"] = values_map(self.celpy, values)
        for program in self.validations:
            result = program.evaluate(act)
            if not (isinstance(result, self.celpy.celtypes.BoolType) and bool(result)):
                return False
        return True


def values_map(celpy: Any, values: dict[str, Any]) -> Any:
    return celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in values.items()})


@pytest.fixture(scope="module")
def policy(render) -> Policy:
    return Policy(one(render(), "ValidatingAdmissionPolicy", "vllmfit-gpu-inventory"))


INV = json.dumps({"schemaVersion": 1, "sampledAt": "2026-01-01T00:00:00Z", "gpus": []})
FORGED = json.dumps({"schemaVersion": 1, "sampledAt": "2026-01-01T00:00:00Z",
                     "gpus": [{"index": 0, "uuid": "GPU-0", "product": "X", "totalBytes": 10**30}]})


def test_the_agent_writes_its_own_node(policy: Policy) -> None:
    assert policy.allows(AGENT_SA, _node("gpu-1"), _node("gpu-1", INV), node_claim="gpu-1")
    assert policy.allows(AGENT_SA, _node("gpu-1", INV), _node("gpu-1", FORGED), node_claim="gpu-1")


def test_the_agent_may_not_write_another_node(policy: Policy) -> None:
    assert not policy.allows(AGENT_SA, _node("gpu-2"), _node("gpu-2", FORGED), node_claim="gpu-1")
    assert not policy.allows(AGENT_SA, _node("gpu-2"), _node("gpu-2", FORGED))  # a token without the claim


def test_nobody_else_writes_the_inventory(policy: Policy) -> None:
    for user in ("alice", "system:serviceaccount:other:agent", "system:node:gpu-1"):
        assert not policy.allows(user, _node("gpu-1", INV), _node("gpu-1", FORGED), node_claim="gpu-1")
        assert not policy.allows(user, _node("gpu-1", INV), _node("gpu-1"))  # removing it is writing it
    assert not policy.allows("alice", None, _node("new-node", FORGED))  # nor creates a node with one


def test_other_writers_keep_their_node_updates(policy: Policy) -> None:
    # kubelet, GFD, NFD and people change labels and other annotations: not this policy's business
    assert policy.allows("system:node:gpu-1", _node("gpu-1", INV), _node("gpu-1", INV, labels={"a": "b"}, x="1"))
    assert policy.allows("alice", None, _node("new-node"))


def test_the_agent_changes_nothing_else(policy: Policy) -> None:
    old = _node("gpu-1", INV)
    assert not policy.allows(AGENT_SA, old, _node("gpu-1", INV, labels={"nvidia.com/gpu.count": "64"}),
                             node_claim="gpu-1")
    assert not policy.allows(AGENT_SA, old, _node("gpu-1", INV, note="x"), node_claim="gpu-1")
    tainted = _node("gpu-1", INV)
    tainted["spec"]["unschedulable"] = True
    assert not policy.allows(AGENT_SA, old, tainted, node_claim="gpu-1")
