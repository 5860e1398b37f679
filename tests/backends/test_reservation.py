"""Device-plugin backend, pure part: which reservations to make, what a reported GPU means, and
the manifests (validated against the official schemas of every supported Kubernetes version)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllmfit.backends import binding
from vllmfit.backends import reservation as rsv
from vllmfit.core.memory import Footprint
from vllmfit.core.placement import Booking
from vllmfit.core.spec import api

KUBE = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0"]
U = ["GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000",
     "GPU-cccccccc-0000-0000-0000-000000000000"]


def pod(name: str, node: str, index: int, uuid: str | None = None, **meta: object) -> dict:
    p = rsv.reservation_pod(rsv.Config(namespace="vllmfit"), node, index, name)
    if uuid:
        p["metadata"]["annotations"][rsv.ANNOTATION_UUID] = uuid
    p["metadata"].update(meta)
    return p


@pytest.mark.parametrize("version", KUBE)
def test_reservation_pod_validates_strictly(version: str) -> None:
    cfg = rsv.Config(namespace="vllmfit", image="ghcr.io/vllmfit/vllmfit:1.0", priority_class="vllmfit-reservation",
                     runtime_class="nvidia", service_account="vllmfit-reservation")
    assert kubernetes_validate.validate(rsv.reservation_pod(cfg, "node-a", 3, "vllmfit-gpu-x-3"), version,
                                        strict=True)


def test_reservation_pod_requests_one_gpu_runs_non_root_and_is_found_again() -> None:
    p = pod("r", "node-a", 3)
    c = p["spec"]["containers"][0]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert rsv.gpu_requests(p) == 1
    assert p["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in c["env"]}  # the device plugin sets it
    terms = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["node-a"]
    assert "nodeName" not in p["spec"]  # the scheduler places it (Unschedulable is visible, autoscalers react)
    assert "priorityClassName" not in p["spec"]
    # no controller (kubectl drain needs --force or a --pod-selector that leaves it out); the
    # autoscalers are told to keep its node: tests/operator/test_drain_rules.py has the rules
    assert "ownerReferences" not in p["metadata"]
    ann = p["metadata"]["annotations"]
    assert ann["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert ann["karpenter.sh/do-not-disrupt"] == "true"
    assert rsv.reservation_from_pod(p) == rsv.Reservation("r", "node-a", 3)
    assert rsv.reservation_from_pod(pod("r", "node-a", 3, U[1])) == rsv.Reservation("r", "node-a", 3, U[1])
    ended = pod("r", "node-a", 3, U[1])
    ended["status"] = {"phase": "Failed"}
    assert rsv.reservation_from_pod(ended).terminating  # type: ignore[union-attr]
    other = {"metadata": {"name": "x", "labels": {"app": "y"}}}
    assert rsv.reservation_from_pod(other) is None


@pytest.mark.parametrize("version", KUBE)
def test_gated_shared_replica_pod_validates_strictly(version: str) -> None:
    replica = api.ReplicaPlacement(replica=0, node="node-a", gpus=[api.GpuRef(index=1, uuid=U[1])])
    b = binding.bind(replica, 1, exclusive=False, pins=[U[1]], gated=True)
    spec = {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "env": list(b.env)}], **b.pod}
    manifest = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "a-0-x", "namespace": "default", "annotations": b.annotations}, "spec": spec}
    assert kubernetes_validate.validate(manifest, version, strict=True)
    assert spec["schedulingGates"] == [{"name": "vllmfit.dev/gpu-reservation"}]
    assert b.annotations == {rsv.ANNOTATION_PINS: U[1]}


def test_unknown_pins_name_no_gpu() -> None:
    replica = api.ReplicaPlacement(replica=0, node="node-a", gpus=[api.GpuRef(index=1)])
    b = binding.bind(replica, 1, exclusive=False, pins=None, gated=True)
    assert {e["name"]: e["value"] for e in b.env}["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_plan_creates_for_unheld_slots_and_deletes_surplus_and_duplicates() -> None:
    slots = {"n": {0: U[0], 1: U[1], 2: U[2]}}
    rs = [rsv.Reservation("a", "n", 0, U[0]),  # holds 0
          rsv.Reservation("b", "n", 1),  # asked for 1, not reported: counts for 1
          rsv.Reservation("c", "n", 2, U[0]),  # asked for 2, got 0: a second holder of 0
          rsv.Reservation("d", "n", 2, U[2], terminating=True)]  # ending: holds nothing
    p = rsv.plan({("n", 0), ("n", 1), ("n", 2)}, rs, slots)
    assert p == rsv.Plan(create=(("n", 2),), delete=("c",))
    # nothing wanted any more: every live one goes
    assert rsv.plan(set(), rs, slots) == rsv.Plan((), ("a", "b", "c"))


def test_a_reported_gpu_of_another_slot_is_a_mismatch_and_unknown_uuids_are_learned() -> None:
    slots: dict[int, str | None] = {0: U[0], 1: U[1]}
    assert rsv.mismatch(rsv.Reservation("r", "n", 1, U[0]), slots) == 0
    assert rsv.mismatch(rsv.Reservation("r", "n", 1, U[1]), slots) is None
    assert rsv.mismatch(rsv.Reservation("r", "n", 1), slots) is None
    gfd: dict[int, str | None] = {0: None, 1: None}
    rs = [rsv.Reservation("r", "n", 1, U[2]), rsv.Reservation("s", "m", 0, U[0])]
    assert rsv.learned_uuids(rs, "n", gfd) == {1: U[2]}
    assert rsv.serves(rs[0], gfd) == 1
    assert rsv.pins("n", [1], {1: U[2]}) == [U[2]]
    assert rsv.pins("n", [0, 1], {1: U[2]}) is None


def test_swap_moves_bookings_and_placement_between_two_gpus() -> None:
    fp = Footprint(1, 2, 3, 4, 0, 0)
    bs = [Booking("ns/a", 0, "n", 1, fp), Booking("ns/a", 1, "m", 1, fp)]
    assert [(b.node, b.index) for b in rsv.swap_bookings(bs, "n", 1, 0)] == [("n", 0), ("m", 1)]
    pl = [api.ReplicaPlacement(replica=0, node="n", gpus=[api.GpuRef(index=1, uuid=U[1])])]
    [p] = rsv.swap_placement(pl, "n", 1, 0, {0: U[0], 1: U[1]})
    assert (p.gpus[0].index, p.gpus[0].uuid) == (0, U[0])


def test_gate_opens_only_when_every_pinned_gpu_is_held() -> None:
    assert rsv.gate_open([U[0], U[1]], {U[0], U[1], U[2]})
    assert not rsv.gate_open([U[0], U[1]], {U[0]})
    assert not rsv.gate_open([], {U[0]})


def test_names_are_stable_per_slot_and_never_collide() -> None:
    a = rsv.reservation_name("node-a", 1, [])
    assert a == rsv.reservation_name("node-a", 1, ["x"]) and a.startswith("vllmfit-gpu-") and a.endswith("-1")
    assert rsv.reservation_name("node-a", 1, [a]) == f"{a}-1"
    assert rsv.reservation_name("node-a", 1, [a, f"{a}-1"]) == f"{a}-2"
    assert len(rsv.reservation_name("n" * 253, 99, [])) <= 63


def test_free_for_others_is_allocatable_minus_requests_of_live_bound_pods() -> None:
    node = {"metadata": {"name": "n"}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}}
    res = pod("r", "n", 0)
    res["spec"]["nodeName"] = "n"
    big = {"spec": {"nodeName": "n", "containers": [{"resources": {"limits": {"nvidia.com/gpu": "2"}}},
                                                    {"resources": {"requests": {"nvidia.com/gpu": 1}}}],
                    "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": 4}}}]}}
    done = {"spec": {"nodeName": "n", "containers": [{"resources": {"limits": {"nvidia.com/gpu": 3}}}]},
            "status": {"phase": "Succeeded"}}
    elsewhere = {"spec": {"nodeName": "m", "containers": [{"resources": {"limits": {"nvidia.com/gpu": 3}}}]}}
    # 8 - 1 (reservation) - max(2 + 1, 4) (init containers run first) = 3
    assert rsv.free_for_others(node, [res, big, done, elsewhere]) == 3


# --- issue 21 item 7: a reservation lands where its deployments may --------------------------------

def test_a_reservation_carries_the_tolerations_of_the_deployments_on_its_gpu_and_pull_secrets() -> None:
    def spec(*tols: dict) -> api.VLLMDeploymentSpec:
        return api.VLLMDeploymentSpec.model_validate({"model": "m", "podTemplate": {"spec": {"tolerations": list(tols)}}})

    infra = {"key": "dedicated", "value": "infra", "effect": "NoSchedule"}
    spot = {"key": "spot", "operator": "Exists"}
    tols = rsv.tolerations_for([spec(infra), spec(spot, infra), api.VLLMDeploymentSpec(model="m")])
    assert sorted(tols, key=str) == sorted([infra, spot], key=str)
    cfg = rsv.Config(namespace="vllmfit", image_pull_secrets=("regcred",))
    pod = rsv.reservation_pod(cfg, "n", 0, "r", tols)
    assert pod["spec"]["tolerations"][0] == {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert pod["spec"]["tolerations"][1:] == tols
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert "imagePullSecrets" not in rsv.reservation_pod(rsv.Config(), "n", 0, "r")["spec"]


def test_the_runtime_class_of_sharing_replicas_is_the_configured_one_not_a_constant() -> None:
    r = api.ReplicaPlacement(replica=0, node="n", gpus=[api.GpuRef(index=0, uuid="GPU-0")])
    assert binding.bind(r, 1, exclusive=False).pod["runtimeClassName"] == "nvidia"  # the chart's default
    assert binding.bind(r, 1, exclusive=False, runtime_class="nvidia-legacy").pod["runtimeClassName"] == "nvidia-legacy"
    assert "runtimeClassName" not in binding.bind(r, 1, exclusive=False, runtime_class="").pod  # the default runtime
    assert "runtimeClassName" not in binding.bind(r, 1, exclusive=True, runtime_class="x").pod  # limits need none


# --- issue 21 item 1: who counts as a reservation ---------------------------------------------------

def _res_pod(ns: str, owners: list[dict] | None = None) -> dict:
    p = rsv.reservation_pod(rsv.Config(namespace="vllmfit"), "n", 0, "r")
    p["metadata"]["namespace"] = ns
    if owners is not None:
        p["metadata"]["ownerReferences"] = owners
    return p


def test_only_pods_in_vllmfits_namespace_not_made_by_another_controller_count() -> None:
    cfg = rsv.Config(namespace="vllmfit")
    assert rsv.untrusted(_res_pod("vllmfit"), cfg) is None
    assert rsv.reservation_from_pod(_res_pod("vllmfit"), cfg) == rsv.Reservation("r", "n", 0)
    assert "namespace 'tenant-a'" in (rsv.untrusted(_res_pod("tenant-a"), cfg) or "")
    assert rsv.reservation_from_pod(_res_pod("tenant-a"), cfg) is None
    rs = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "x", "uid": "u1", "controller": True}]
    assert "controlled by ReplicaSet x" in (rsv.untrusted(_res_pod("vllmfit", rs), cfg) or "")
    not_controller = [{**rs[0], "controller": False}]
    assert rsv.untrusted(_res_pod("vllmfit", not_controller), cfg) is None


def test_with_an_owner_uid_only_pods_it_controls_count() -> None:
    cfg = rsv.Config(namespace="vllmfit", owner_uid="anchor-uid")
    mine = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "vllmfit-reservation", "uid": "anchor-uid",
             "controller": True}]
    assert rsv.untrusted(_res_pod("vllmfit", mine), cfg) is None
    assert rsv.untrusted(_res_pod("vllmfit"), cfg) == "it is not controlled by vllmfit's owner object"
    assert rsv.untrusted(_res_pod("vllmfit", [{**mine[0], "uid": "other"}]), cfg) is not None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["r0", "r1", "r2", "r3"]), st.sampled_from(["a", "b", "c"]),
                          st.integers(0, 1), st.sampled_from([None, U[0], U[1]]), st.booleans(),
                          st.sampled_from(["put", "setdefault", "pop"])), max_size=30))
def test_known_reservations_answer_as_a_pass_over_all_of_them(ops: list) -> None:
    """rsv.Known's indices (a node's reservations, the live reported ones) say what a filter over
    every reservation says, whatever the order of creations, replacements (a reservation moving
    node, reporting, terminating) and deletions."""
    known, plain = rsv.Known(), {}
    for name, node, index, uuid, terminating, op in ops:
        r = rsv.Reservation(name, node, index, uuid, terminating)
        if op == "put":
            known[name], plain[name] = r, r
        elif op == "setdefault":
            assert known.setdefault(name, r) == plain.setdefault(name, r)
        else:
            assert known.pop(name, None) == plain.pop(name, None)
        assert dict(known) == plain and len(known) == len(plain) and list(known.values()) == list(plain.values())
        for n in ("a", "b", "c"):
            assert sorted(known.on(n), key=lambda r: r.name) == sorted(
                (r for r in plain.values() if r.node == n), key=lambda r: r.name)
            assert rsv.held_uuids(known.on(n), n) == rsv.held_uuids(plain.values(), n)
        assert known.reported_live() == sorted((r for r in plain.values() if r.reported and not r.terminating),
                                               key=lambda r: r.name)
