"""Issue 21 item 7: placement honours cordons and NoSchedule/NoExecute taints like the
kube-scheduler (TaintToleration and NodeUnschedulable filters), with the tolerations of
spec.podTemplate. Written first: on the old code every booking below went to the cordoned or
tainted node (it is the emptiest, so best fit and spread both chose it) and NodeInfo had no taints."""

from __future__ import annotations

from dataclasses import replace

import pytest
from placement_fakes import H100, node, request

from vllmfit.core import placement
from vllmfit.core.placement import taints

SMALL = {"maxModelLen": 8192, "kvCache": {"concurrency": 8}}


def tainted(name: str, *ts: dict[str, str], cordon: bool = False) -> placement.NodeInfo:
    t = tuple(taints.Taint(x["key"], x.get("value", ""), x["effect"]) for x in ts)
    return replace(node(name, H100, 1), taints=t, unschedulable=cordon)


def busy(name: str) -> placement.NodeInfo:
    return node(name, H100, 1, foreign={0: 40 << 30})  # the fuller node: best fit would take the other


def decide(nodes: list[placement.NodeInfo], **spec: object) -> placement.Decision:
    return placement.decide(placement.Ledger(nodes), request("a", **{**SMALL, **spec}))


def test_a_cordoned_node_gets_no_new_booking() -> None:
    d = decide([tainted("free", cordon=True), busy("used")], placement={"policy": "spread"})
    assert d.admitted and [r.node for r in d.replicas] == ["used"]


def test_only_cordoned_nodes_say_so_like_the_scheduler() -> None:
    d = decide([tainted("a", cordon=True), tainted("b", cordon=True)])
    assert not d.admitted
    assert "0/2 nodes are available: 2 node(s) were unschedulable" in d.message


def test_an_untolerated_noschedule_taint_excludes_the_node_and_is_named() -> None:
    infra = {"key": "dedicated", "value": "infra", "effect": "NoSchedule"}
    d = decide([tainted("a", infra)])
    assert not d.admitted and "1 node(s) had untolerated taint {dedicated: infra}" in d.message
    d = decide([tainted("a", infra), busy("b")], placement={"policy": "spread"})
    assert [r.node for r in d.replicas] == ["b"]


@pytest.mark.parametrize("toleration", [
    {"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"},
    {"key": "dedicated", "value": "infra"},  # Equal is the default; an empty effect matches all
    {"key": "dedicated", "operator": "Exists"},
    {"operator": "Exists"},  # an empty key with Exists tolerates everything
])
def test_a_toleration_in_the_pod_template_lets_the_node_in(toleration: dict[str, str]) -> None:
    infra = {"key": "dedicated", "value": "infra", "effect": "NoSchedule"}
    d = decide([tainted("a", infra)], podTemplate={"spec": {"tolerations": [toleration]}})
    assert d.admitted and d.replicas[0].node == "a"


@pytest.mark.parametrize("toleration", [
    {"key": "dedicated", "value": "other"},
    {"key": "dedicated", "value": "infra", "effect": "NoExecute"},
    {"key": "other", "operator": "Exists"},
    {"value": "infra"},  # Equal with an empty key matches nothing
])
def test_tolerations_that_do_not_match_keep_it_out(toleration: dict[str, str]) -> None:
    infra = {"key": "dedicated", "value": "infra", "effect": "NoSchedule"}
    assert not decide([tainted("a", infra)], podTemplate={"spec": {"tolerations": [toleration]}}).admitted


def test_the_gpu_taint_prefer_no_schedule_and_admission_defaults_are_tolerated() -> None:
    d = decide([tainted("a", {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                       {"key": "spot", "effect": "PreferNoSchedule"},
                       {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"})])
    assert d.admitted


def test_a_noexecute_taint_is_not_tolerated_without_a_toleration() -> None:
    d = decide([tainted("a", {"key": "maintenance", "value": "now", "effect": "NoExecute"})])
    assert not d.admitted and "untolerated taint {maintenance: now}" in d.message


def test_a_pin_to_a_cordoned_node_says_why() -> None:
    d = decide([tainted("a", cordon=True)], placement={"nodeName": "a", "allowReschedule": False})
    assert not d.admitted and "a: is unschedulable" in d.message


def test_a_cordon_is_tolerated_by_its_own_toleration() -> None:
    tol = {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}
    assert decide([tainted("a", cordon=True)], podTemplate={"spec": {"tolerations": [tol]}}).admitted


def test_existing_bookings_stay_on_a_node_cordoned_later() -> None:
    ledger = placement.Ledger([node("a", H100, 1)])
    d = placement.decide(ledger, request("a", **SMALL))
    ledger.book(d)
    ledger.set_node(tainted("a", cordon=True))
    assert [b.node for b in ledger.bookings_of("default/a")] == ["a"]


def node_obj(spec: dict[str, object]) -> dict[str, object]:
    return {"metadata": {"name": "n", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                                                 "nvidia.com/gpu.count": "1", "nvidia.com/gpu.memory": "81559"}},
            "spec": spec}


def test_read_node_carries_taints_and_the_cordon() -> None:
    from vllmfit.sources import catalog
    r = placement.read_node(node_obj({"unschedulable": True, "taints": [
        {"key": "b", "value": "1", "effect": "NoExecute"}, {"key": "a", "effect": "NoSchedule"},
        {"key": "x", "effect": "Bogus"}, "junk", {"effect": "NoSchedule"}]}), catalog.gpu_for_label)
    assert r.info is not None and r.info.unschedulable
    assert r.info.taints == (taints.Taint("a", "", "NoSchedule"), taints.Taint("b", "1", "NoExecute"))


def test_too_many_taints_is_a_node_that_takes_nothing_new() -> None:
    from vllmfit.sources import catalog
    many = [{"key": f"k{i}", "effect": "NoSchedule"} for i in range(taints.MAX_TAINTS + 1)]
    r = placement.read_node(node_obj({"taints": many}), catalog.gpu_for_label)
    assert r.info is not None and r.info.unschedulable and r.info.taints == ()
    assert any("spec.taints" in w for w in r.warnings)


# --- issue 21 item 5: where no binding of the device-plugin backend can hold a GPU ------------------

def labelled(**labels: str) -> dict[str, object]:
    obj = node_obj({})
    obj["metadata"]["labels"].update(labels)  # type: ignore[index]
    return obj


@pytest.mark.parametrize("labels,why", [
    ({"nvidia.com/gpu.replicas": "4", "nvidia.com/gpu.sharing-strategy": "time-slicing"},
     "node(s) shared each GPU through the device plugin (time-slicing, nvidia.com/gpu.replicas=4)"),
    ({"nvidia.com/gpu.sharing-strategy": "mps", "nvidia.com/gpu.replicas": "2"}, "(mps, nvidia.com/gpu.replicas=2)"),
    ({"nvidia.com/gpu.replicas": "8"}, "(time-slicing or MPS, nvidia.com/gpu.replicas=8)"),
    ({"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}, "node(s) ran GKE's GPU driver"),
    ({"vllmfit.dev/binding": "none"}, "node(s) had label vllmfit.dev/binding=none"),
])
def test_a_node_without_a_safe_binding_gets_nothing_and_says_why(labels: dict[str, str], why: str) -> None:
    from vllmfit.sources import catalog
    r = placement.read_node(labelled(**labels), catalog.gpu_for_label)
    assert r.info is not None and r.info.unsafe is not None and why in r.info.unsafe
    d = placement.decide(placement.Ledger([r.info]), request("a", **SMALL))
    assert not d.admitted and why in d.message


@pytest.mark.parametrize("labels", [
    {"nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.sharing-strategy": "none"},
    {"cloud.google.com/gke-accelerator": "nvidia-l4", "nvidia.com/gpu.deploy.container-toolkit": "true"},
    {"nvidia.com/gpu.replicas": "4", "vllmfit.dev/binding": "visible-devices"},  # the administrator vouches
])
def test_nodes_with_a_safe_binding_are_used(labels: dict[str, str]) -> None:
    from vllmfit.sources import catalog
    r = placement.read_node(labelled(**labels), catalog.gpu_for_label)
    assert r.info is not None and r.info.unsafe is None
    assert placement.decide(placement.Ledger([r.info]), request("a", **SMALL)).admitted
