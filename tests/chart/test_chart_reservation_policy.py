"""The admission policy that lets the reservation pods' service account change nothing but the
vllmfit.dev/gpu-uuid annotation of its own pod (issue 21: "the service account of reservation
pods can do nothing"). Its CEL is evaluated with cel-python against the requests the API server
would send (userInfo with the pod-name claim of a bound service-account token)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from .conftest import NAMESPACE, find, one

SA = f"system:serviceaccount:{NAMESPACE}:vllmfit-reservation"
KEY = "vllmfit.dev/gpu-uuid"
POD_CLAIM = "authentication.kubernetes.io/pod-name"


def test_the_policy_is_installed_where_the_api_exists(render) -> None:
    assert find(render("default", "--kube-version", "1.35"), "ValidatingAdmissionPolicy", "vllmfit-gpu-reservation")
    assert not find(render("default", "--kube-version", "1.29"), "ValidatingAdmissionPolicy", "vllmfit-gpu-reservation")
    assert not find(render("default", "--set", "placement.reservation.uuidWriterPolicy=false"),
                    "ValidatingAdmissionPolicy", "vllmfit-gpu-reservation")
    policy = one(render(), "ValidatingAdmissionPolicy", "vllmfit-gpu-reservation")
    assert policy["spec"]["matchConditions"][0]["expression"] == f'request.userInfo.username == "{SA}"'
    assert policy["spec"]["matchConstraints"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}


class Policy:
    def __init__(self, doc: dict[str, Any]) -> None:
        celpy = pytest.importorskip("celpy", reason="cel-python is not installed: CEL not evaluated")
        self.celpy, env = celpy, celpy.Environment()
        self.variables = [(v["name"], env.program(env.compile(v["expression"]))) for v in doc["spec"]["variables"]]
        self.validations = [env.program(env.compile(v["expression"])) for v in doc["spec"]["validations"]]

    def allows(self, old: dict[str, Any] | None, new: dict[str, Any] | None, pod_claim: str | None,
               operation: str = "UPDATE", sub: str = "") -> bool:
        c = self.celpy
        extra = {POD_CLAIM: [pod_claim]} if pod_claim else {}
        request = {"userInfo": {"username": SA, "extra": extra}, "operation": operation, "subResource": sub}
        act: dict[str, Any] = {"object": c.json_to_cel(new) if new is not None else None,
                               "oldObject": c.json_to_cel(old) if old is not None else None,
                               "request": c.json_to_cel(request)}
        values: dict[str, Any] = {}
        for name, program in self.variables:
            act["variables"] = c.celtypes.MapType({c.celtypes.StringType(k): v for k, v in values.items()})
            values[name] = program.evaluate(act)
        act["variables"] = c.celtypes.MapType({c.celtypes.StringType(k): v for k, v in values.items()})
        return all(isinstance(r := p.evaluate(act), c.celtypes.BoolType) and bool(r) for p in self.validations)


@pytest.fixture(scope="module")
def policy(render) -> Policy:
    return Policy(one(render(), "ValidatingAdmissionPolicy", "vllmfit-gpu-reservation"))


def pod(name: str, uuid: str | None = None, **labels: str) -> dict[str, Any]:
    ann = {"vllmfit.dev/reserve-node": "gpu-a", "vllmfit.dev/reserve-gpu": "0"}
    if uuid:
        ann[KEY] = uuid
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE, "annotations": ann,
                                                           "labels": {"vllmfit.dev/role": "gpu-reservation", **labels}},
            "spec": {"nodeName": "gpu-a", "containers": [{"name": "reserve", "image": "vllmfit"}]}}


def test_a_reservation_reports_the_uuid_on_its_own_pod(policy: Policy) -> None:
    assert policy.allows(pod("r0"), pod("r0", "GPU-1"), pod_claim="r0")


def test_it_may_not_report_for_another_pod_or_without_the_claim(policy: Policy) -> None:
    assert not policy.allows(pod("r1"), pod("r1", "GPU-1"), pod_claim="r0")
    assert not policy.allows(pod("r0"), pod("r0", "GPU-1"), pod_claim=None)


def test_it_may_change_nothing_else(policy: Policy) -> None:
    assert not policy.allows(pod("r0"), pod("r0", "GPU-1", extra="x"), pod_claim="r0")  # a label
    changed = copy.deepcopy(pod("r0"))
    changed["metadata"]["annotations"]["vllmfit.dev/reserve-gpu"] = "3"
    assert not policy.allows(pod("r0"), changed, pod_claim="r0")  # another annotation
    spec = copy.deepcopy(pod("r0", "GPU-1"))
    spec["spec"]["containers"][0]["image"] = "evil"
    assert not policy.allows(pod("r0"), spec, pod_claim="r0")
    assert not policy.allows(None, pod("new"), pod_claim="r0", operation="CREATE")
    assert not policy.allows(pod("r0"), None, pod_claim="r0", operation="DELETE")
    assert not policy.allows(pod("r0"), pod("r0", "GPU-1"), pod_claim="r0", sub="status")
