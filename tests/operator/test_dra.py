"""DRA backend against the emulator: one ResourceClaimTemplate per replica asking for the booked
memory on the chosen GPUs, claims vllmfit did not make counted as foreign use, the scheduler's
allocation failures reported, a node moved from the device plugin to DRA, restarts.

The emulator has no scheduler and no resourceclaim controller: `allocate` writes a claim with
an allocation result as the scheduler would (consumedCapacity rounded up to the device's step)."""

from __future__ import annotations

import copy
import json
import math
import uuid as uuidlib
from typing import Any

import kmock
import kubernetes_validate
import pytest
from opkit import DEPLOYMENTS, H100, PODS, Cluster, Emulator, Operator, node, vd
from reservationkit import U, asked, gpu_node, replica_pod

from vllmfit.backends import dra

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
GIB, MIB = 1 << 30, 1 << 20
G = "resource.k8s.io"
SLICES, CLAIMS, TEMPLATES = f"{G}/v1/resourceslices", f"{G}/v1/resourceclaims", f"{G}/v1/resourceclaimtemplates"


def nvidia_slice(node_name: str, n: int, *, generation: int = 1) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node_name}-gpu.nvidia.com-x", "uid": str(uuidlib.uuid4()), "resourceVersion": "1"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": node_name,
                     "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1},
                     "devices": [{"name": f"gpu-{i}", "allowMultipleAllocations": True,
                                  "attributes": {"type": {"string": "gpu"}, "uuid": {"string": U[i]},
                                                 "productName": {"string": "NVIDIA H100 80GB HBM3"}},
                                  "capacity": {"memory": {"value": "81559Mi", "requestPolicy": {
                                      "default": "81559Mi",
                                      "validRange": {"min": "1Mi", "max": "81559Mi", "step": "1Mi"}}}}}
                                 for i in range(n)]}}


def dra_node(name: str, n: int) -> dict[str, Any]:
    """A node whose GPUs the NVIDIA DRA driver publishes (no device plugin: no nvidia.com/gpu)."""
    obj = node(name, gpus=n, product=H100)
    obj["status"] = {"capacity": {}, "allocatable": {}}
    return obj


async def create(cluster: Cluster, obj: dict[str, Any]) -> None:
    group, version = obj["apiVersion"].split("/")
    plural = {"ResourceSlice": "resourceslices", "ResourceClaim": "resourceclaims"}[obj["kind"]]
    if obj["kind"] == "ResourceSlice":
        await cluster.custom.create_cluster_custom_object(group, version, plural, obj)
    else:
        await cluster.custom.create_namespaced_custom_object(group, version, obj["metadata"]["namespace"], plural, obj)


async def allocate(cluster: Cluster, name: str, node_name: str, device: str, consumed: str | None, *,
                   ns: str = "default", labels: dict[str, str] | None = None) -> None:
    """A claim the scheduler allocated on `device` (consumedCapacity None: the whole device)."""
    result: dict[str, Any] = {"request": "gpu0", "driver": "gpu.nvidia.com", "pool": node_name, "device": device}
    if consumed:
        result.update(shareID=str(uuidlib.uuid4()), consumedCapacity={"memory": consumed})
    await create(cluster, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns, "uid": str(uuidlib.uuid4()), "resourceVersion": "1",
                     "labels": labels or {}},
        "spec": {"devices": {"requests": [{"name": "gpu0", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {"allocation": {"devices": {"results": [result]}}}})


async def release(cluster: Cluster, name: str, ns: str = "default") -> None:
    await cluster.custom.delete_namespaced_custom_object(G, "v1", ns, "resourceclaims", name)


def templates(cluster: Cluster, owner: str | None = None) -> list[dict[str, Any]]:
    out = [t for t in cluster.objects(TEMPLATES)
           if owner is None or t["metadata"]["labels"].get("vllmfit.dev/deployment") == owner]
    return sorted(out, key=lambda t: t["metadata"]["name"])


def requests_of(t: dict[str, Any]) -> list[tuple[str, int]]:
    """(pinned UUID, bytes) per request."""
    out = []
    for r in t["spec"]["spec"]["devices"]["requests"]:
        expr = r["exactly"]["selectors"][0]["cel"]["expression"]
        out.append((expr.split('"')[-2], dra.quantity_bytes(r["exactly"]["capacity"]["requests"]["memory"])))
    return out


def pod_spec(cluster: Cluster, deployment: str) -> dict[str, Any]:
    return cluster.get(DEPLOYMENTS, deployment)["spec"]["template"]["spec"]


def booked(cluster: Cluster, name: str) -> list[tuple[int, int]]:
    return [(m["index"], m["totalBytes"]) for m in cluster.status(name)["memory"]]


def condition(cluster: Cluster, name: str, type_: str) -> dict[str, Any]:
    return next((c for c in cluster.status(name).get("conditions") or [] if c["type"] == type_), {})


async def one_template(cluster: Cluster, name: str, uuid: str) -> dict[str, Any]:
    await cluster.until(lambda: [u for t in templates(cluster, name) for u, _ in requests_of(t)] == [uuid],
                        what=f"one template for {name} on {uuid}")
    [t] = templates(cluster, name)
    return t


async def test_a_replica_on_a_dra_node_claims_its_booked_memory_on_its_gpu(cluster: Cluster,
                                                                           operator: Operator) -> None:
    await cluster.create(dra_node("gpu-d", 2))
    await create(cluster, nvidia_slice("gpu-d", 2))
    await cluster.create(vd("a", QWEN7, placement={"nodeName": "gpu-d", "gpuIndices": [1]}))
    await cluster.phase("a", "Admitted")
    [(index, total)] = booked(cluster, "a")
    t = await one_template(cluster, "a", U[1])
    assert index == 1 and requests_of(t) == [(U[1], total)]  # exactly the bytes booked there
    for version in ("1.34.0", "1.35.0", "1.36.0"):
        assert kubernetes_validate.validate(t, version, strict=True)
    assert t["spec"]["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "vllmfit",
                                               "vllmfit.dev/deployment": "a", "vllmfit.dev/replica": "0"}
    [ref] = t["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"]) == ("VLLMDeployment", "a")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    spec = pod_spec(cluster, "a-0")
    assert spec["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": t["metadata"]["name"]}]
    c = spec["containers"][0]
    assert c["resources"]["claims"] == [{"name": "gpus"}]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert "runtimeClassName" not in spec and "schedulingGates" not in spec
    assert {e["name"]: e.get("value") for e in c["env"]}["NVIDIA_VISIBLE_DEVICES"] == "void"  # the claim brings the GPU (issue 21)
    pod = await replica_pod(cluster, "a-0")
    for version in ("1.34.0", "1.35.0", "1.36.0"):
        assert kubernetes_validate.validate(cluster.get(PODS, pod), version, strict=True)
        assert kubernetes_validate.validate(cluster.get(DEPLOYMENTS, "a-0"), version, strict=True)
    assert asked(cluster) == []  # no reservation pods on a DRA node
    # the claim the controller makes from the template, allocated with exactly that much: no foreign use
    await allocate(cluster, "a-0-x-gpus-abcde", "gpu-d", "gpu-1", dra.quantity(total), labels=t["spec"]["metadata"][
        "labels"])
    await cluster.store.writer.flush()
    assert cluster.status("a")["gpus"][0]["usedBytes"] == total


async def test_a_foreign_claim_before_admission_is_foreign_use(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(dra_node("gpu-d", 2))
    await create(cluster, nvidia_slice("gpu-d", 2))
    await allocate(cluster, "training", "gpu-d", "gpu-0", "60Gi", ns="research")
    await cluster.until(lambda: cluster.store.books.ledger.slot("gpu-d", 0) and cluster.store.books.ledger.slot(
        "gpu-d", 0).foreign_bytes == 60 * GIB, what="the claim to count")
    await cluster.create(vd("pinned", QWEN7, placement={"nodeName": "gpu-d", "gpuIndices": [0]}))
    st = await cluster.phase("pinned", "Admitted")
    [(i, need)] = booked(cluster, "pinned")
    assert i == 1
    free = (math.ceil(0.9 * cluster.store.books.ledger.slot("gpu-d", 0).capacity_bytes) + int(0.55 * GIB)
            - 60 * GIB) / GIB  # the counted policy: ceil(0.9 T) + one CUDA context
    assert st["warnings"] == [(f"pinned placement does not fit (gpu-d: GPU 0 needs {need / GIB:.1f} GiB, {free:.1f} GiB "
                               "of budget left); "
                              "placed on gpu-d GPU 1 instead")]
    await one_template(cluster, "pinned", U[1])
    await release(cluster, "training", "research")  # the job ends: GPU 0 is free again
    await cluster.until(lambda: cluster.store.books.ledger.slot("gpu-d", 0).foreign_bytes == 0)
    await cluster.create(vd("second", QWEN7, placement={"nodeName": "gpu-d", "gpuIndices": [0]}))
    await cluster.phase("second", "Admitted")
    assert [i for i, _ in booked(cluster, "second")] == [0]
    await one_template(cluster, "second", U[0])


async def test_a_foreign_claim_after_admission_moves_the_replica(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(dra_node("gpu-d", 2))
    await create(cluster, nvidia_slice("gpu-d", 2))
    await cluster.create(vd("a", QWEN7))
    await cluster.phase("a", "Admitted")
    [(i, _)] = booked(cluster, "a")
    await one_template(cluster, "a", U[i])
    await allocate(cluster, "big-job", "gpu-d", f"gpu-{i}", "60Gi", ns="research")
    await cluster.until(lambda: [j for j, _ in booked(cluster, "a")] == [1 - i], what="a to move")
    await one_template(cluster, "a", U[1 - i])  # the old template is gone, the new one pins the other GPU
    await cluster.event("a", "Moved")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0")  # a move stops, then writes it again
                        and pod_spec(cluster, "a-0")["resourceClaims"][0]["resourceClaimTemplateName"]
                        == templates(cluster, "a")[0]["metadata"]["name"])


async def test_an_allocation_race_lost_is_reported_in_the_schedulers_words(cluster: Cluster,
                                                                          operator: Operator) -> None:
    await cluster.create(dra_node("gpu-d", 2))
    await create(cluster, nvidia_slice("gpu-d", 2))
    await cluster.create(vd("a", QWEN7))
    await cluster.phase("a", "Admitted")
    [(i, _)] = booked(cluster, "a")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    pod = await replica_pod(cluster, "a-0")
    message = ("0/1 nodes are available: 1 cannot allocate all claims. still not schedulable, preemption: 0/1 "
               "nodes are available: 1 Preemption is not helpful for scheduling.")
    await cluster.patch_pod(pod, {"status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}})
    await cluster.until(lambda: condition(cluster, "a", "Placed").get("reason") == "AllocationFailed",
                        what="the Placed condition")
    assert message in condition(cluster, "a", "Placed")["message"]
    await cluster.until(lambda: any(e["reason"] == "AllocationFailed" and message in e["message"]
                                    for e in cluster.events("a")), what="the AllocationFailed Event")  # posted after the status
    # the claim that won shows up: a is decided again onto the other GPU
    await allocate(cluster, "winner", "gpu-d", f"gpu-{i}", "55Gi", ns="research")
    await cluster.until(lambda: [j for j, _ in booked(cluster, "a")] == [1 - i], what="a to move")
    await cluster.until(lambda: condition(cluster, "a", "Placed").get("status") == "True")
    await one_template(cluster, "a", U[1 - i])


async def test_the_rounded_up_consumed_capacity_is_what_the_ledger_counts(cluster: Cluster,
                                                                          operator: Operator) -> None:
    await cluster.create(dra_node("gpu-d", 1))
    await create(cluster, nvidia_slice("gpu-d", 1))
    await cluster.create(vd("a", QWEN7))
    await cluster.phase("a", "Admitted")
    [(_, total)] = booked(cluster, "a")
    [t] = templates(cluster, "a")
    rounded = -(-total // (8 * GIB)) * 8 * GIB  # a driver with an 8Gi step (dra-example-driver) rounds up
    await allocate(cluster, "a-0-gpus-x", "gpu-d", "gpu-0", dra.quantity(rounded), labels=t["spec"]["metadata"]["labels"])
    await cluster.until(lambda: cluster.status("a")["gpus"][0]["usedBytes"] == rounded,
                        what="the ledger to count what the claim consumes")
    assert cluster.store.books.ledger.slot("gpu-d", 0).foreign_bytes == rounded - total


async def test_a_node_moves_from_the_device_plugin_to_dra(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(gpu_node("gpu-a", 2))  # the agent reports the same UUIDs the DRA driver will
    pin = {"nodeName": "gpu-a", "gpuIndices": [0]}
    await cluster.create(vd("a", QWEN7, placement=pin))
    await cluster.create(vd("b", QWEN7, maxModelLen=8192, placement=pin))
    await cluster.phase("a", "Admitted")
    await cluster.phase("b", "Admitted")
    await cluster.until(lambda: asked(cluster) == [("gpu-a", 0)], what="a reservation on the device plugin")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "b-0"))
    assert pod_spec(cluster, "a-0")["schedulingGates"]
    before = {n: booked(cluster, n) for n in "ab"}
    # the admin swaps the device plugin for the NVIDIA DRA driver on this node
    await create(cluster, nvidia_slice("gpu-a", 2))
    for n in "ab":
        t = await one_template(cluster, n, U[0])
        assert requests_of(t) == [(U[0], before[n][0][1])]
        await cluster.until(lambda n=n: "resourceClaims" in pod_spec(cluster, f"{n}-0"), what=f"{n} on a claim")
        spec = pod_spec(cluster, f"{n}-0")
        assert "schedulingGates" not in spec and "runtimeClassName" not in spec
    await cluster.until(lambda: asked(cluster) == [], what="the reservation to go")
    assert {n: booked(cluster, n) for n in "ab"} == before  # nothing moved


async def test_capacity_requests_dropped_by_the_api_server_are_refused(cluster: Cluster, operator: Operator,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Kubernetes 1.34/1.35 without DRAConsumableCapacity store claim templates without capacity."""
    handle = Emulator._handle

    async def dropping(self: Any, request: Any) -> Any:
        if request.method == kmock.method.POST and request.resource == kmock.resource(TEMPLATES):
            for r in request.data["spec"]["spec"]["devices"]["requests"]:
                r["exactly"].pop("capacity", None)
            for c in request.data["spec"]["spec"]["devices"].get("constraints") or []:
                c.pop("distinctAttribute", None)
        return await handle(self, request)

    monkeypatch.setattr(Emulator, "_handle", dropping)
    await cluster.create(dra_node("gpu-d", 1))
    await create(cluster, nvidia_slice("gpu-d", 1))
    await cluster.create(vd("a", QWEN7))
    await cluster.until(lambda: any(e["reason"] == "DRACapacityUnsupported" for e in cluster.events("a")))
    await cluster.phase("a", "Unschedulable")  # its only node shares nothing now
    assert templates(cluster) == [] and cluster.get(DEPLOYMENTS, "a-0") is None
    assert "DRAConsumableCapacity" in next(e["message"] for e in cluster.events("a")
                                           if e["reason"] == "DRACapacityUnsupported")


async def test_restart_after_a_foreign_claim_arrived_while_down(km: Any, cluster: Cluster) -> None:
    op = Operator(km)
    await op.start()
    try:
        await cluster.create(dra_node("gpu-d", 2))
        await create(cluster, nvidia_slice("gpu-d", 2))
        await cluster.create(vd("a", QWEN7))
        await cluster.phase("a", "Admitted")
        [(i, _)] = booked(cluster, "a")
        await one_template(cluster, "a", U[i])
        await op.stop()
        await cluster.reconnect()
        await allocate(cluster, "big-job", "gpu-d", f"gpu-{i}", "60Gi", ns="research")
        op = Operator(km)
        await op.start()
        await cluster.until(lambda: [j for j, _ in booked(cluster, "a")] == [1 - i], what="a to move after restart")
        await one_template(cluster, "a", U[1 - i])
        await op.stop()
        await cluster.reconnect()
        seen = copy.deepcopy(templates(cluster))
        op = Operator(km)
        await op.start()  # nothing changed: the same template, no second one
        await cluster.store.writer.flush()
        assert templates(cluster) == seen
        assert cluster.store.books.ledger.slot("gpu-d", i).foreign_bytes == 60 * GIB
        assert json.dumps(booked(cluster, "a")) == json.dumps([(1 - i, seen and requests_of(seen[0])[0][1])])
    finally:
        await op.stop()




async def test_a_booking_the_request_policy_cannot_grant_is_a_condition_and_an_event(cluster: Cluster,
                                                                                    operator: Operator) -> None:
    """A device whose memory policy offers 10Gi or 20Gi cannot give a replica that booked more:
    no claim template, no Deployment, and the tenant sees why (issue 21)."""
    s = nvidia_slice("gpu-d", 1)
    s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"] = {"default": "20Gi",
                                                                      "validValues": ["10Gi", "20Gi"]}
    await cluster.create(dra_node("gpu-d", 1))
    await create(cluster, s)
    await cluster.create(vd("a", QWEN7))
    await cluster.until(lambda: any(e["reason"] == "ClaimNotGrantable" for e in cluster.events("a")),
                        what="a ClaimNotGrantable Event")
    [(_, need)] = booked(cluster, "a")
    assert need > 20 * GIB  # what it booked is more than the policy's largest value
    message = next(e["message"] for e in cluster.events("a") if e["reason"] == "ClaimNotGrantable")
    assert message == (f"replica 0: gpu-d gpu-0: the request policy of its 'memory' capacity cannot grant "
                       f"{dra.quantity(need)} (of 81559Mi; requestPolicy validValues [10Gi, 20Gi])")

    await cluster.until(lambda: condition(cluster, "a", "Placed").get("reason") == "ClaimNotGrantable",
                        what="the condition")
    assert condition(cluster, "a", "Placed")["status"] == "False"
    assert condition(cluster, "a", "Placed")["message"] == message
    assert templates(cluster) == [] and cluster.get(DEPLOYMENTS, "a-0") is None
