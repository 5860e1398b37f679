"""Device-plugin backend against the emulator: reservation pods hold every GPU a replica shares,
replica pods wait behind a scheduling gate, the reported GPU is the one booked and pinned.

The emulator has no scheduler and no device plugin: `DevicePlugin.serve` plays both for
reservation pods (binds each to its node and reports a free GPU, in the plugin's order), and
`replica_pod` plays the ReplicaSet controller (a pod from a Deployment's template)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kubernetes_asyncio import client
from opkit import DEPLOYMENTS, PODS, VD, Cluster, Operator, vd
from reservationkit import (
    QWEN7,
    DevicePlugin,
    U,
    asked,
    gates,
    gpu_node,
    replica_pod,
    reservations,
    shared_pair,
)

from vllmfit.backends import reservation as rsv

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

def visible(cluster: Cluster, deployment: str) -> str:
    env = cluster.get(DEPLOYMENTS, deployment)["spec"]["template"]["spec"]["containers"][0]["env"]
    return next(e["value"] for e in env if e["name"] == "NVIDIA_VISIBLE_DEVICES")


async def settle(cluster: Cluster) -> None:
    await cluster.store.writer.flush()


async def test_shared_gpu_is_held_by_one_reservation_and_the_gate_opens_once_it_reports(
        cluster: Cluster, operator: Operator) -> None:
    await shared_pair(cluster)
    await cluster.until(lambda: asked(cluster) == [("gpu-a", 1)], what="one reservation for gpu-a GPU 1")
    [res] = reservations(cluster)
    for version in ("1.29.0", "1.34.0", "1.35.0", "1.36.0"):
        assert kubernetes_validate.validate(res, version, strict=True)
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and cluster.get(DEPLOYMENTS, "b-0"))
    assert visible(cluster, "a-0") == visible(cluster, "b-0") == U[1]
    pod_a = await replica_pod(cluster, "a-0")
    tpl = cluster.get(DEPLOYMENTS, "a-0")["spec"]["template"]
    assert tpl["spec"]["schedulingGates"] == [{"name": rsv.GATE}]
    assert tpl["metadata"]["annotations"][rsv.ANNOTATION_PINS] == U[1]
    for version in ("1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0"):
        assert kubernetes_validate.validate(cluster.get(PODS, pod_a), version, strict=True)
        assert kubernetes_validate.validate(cluster.get(DEPLOYMENTS, "a-0"), version, strict=True)
    await cluster.until(lambda: ("default", pod_a) in cluster.store.cache.gated or not gates(cluster, pod_a))
    assert gates(cluster, pod_a) == [{"name": rsv.GATE}]  # not held yet: it waits, it does not crash
    dp = DevicePlugin(cluster, {"gpu-a": U[:2]}, order={"gpu-a": [1, 0]})
    assert await dp.serve() == [U[1]]
    await cluster.until(lambda: gates(cluster, pod_a) == [], what="the gate to be lifted")
    pod_b = await replica_pod(cluster, "b-0")  # a pod made after the report is let through too
    await cluster.until(lambda: gates(cluster, pod_b) == [], what="b's gate to be lifted")
    assert asked(cluster) == [("gpu-a", 1)]


async def test_allocatable_minus_what_vllmfit_holds_is_what_others_can_get(
        cluster: Cluster, operator: Operator) -> None:
    """4 GPUs: a and b share GPU 0, c is alone on GPU 1 (not the whole node: no limits). Two
    reservations hold GPUs 0 and 1; another pod can get exactly the 2 GPUs vllmfit does not use."""
    await cluster.create(gpu_node("gpu-a", 4))
    await cluster.create(vd("a", QWEN7, placement={"nodeName": "gpu-a", "gpuIndices": [0]}))
    await cluster.create(vd("b", QWEN7, maxModelLen=8192, placement={"nodeName": "gpu-a", "gpuIndices": [0]}))
    await cluster.create(vd("c", QWEN7, placement={"nodeName": "gpu-a", "gpuIndices": [1]}))
    for name in "abc":
        await cluster.phase(name, "Admitted")
    await cluster.until(lambda: asked(cluster) == [("gpu-a", 0), ("gpu-a", 1)], what="two reservations")
    dp = DevicePlugin(cluster, {"gpu-a": U[:4]})
    await dp.serve()
    await cluster.until(lambda: all(cluster.get(DEPLOYMENTS, f"{n}-0") for n in "abc"))
    for n in "abc":
        await replica_pod(cluster, f"{n}-0")
    await settle(cluster)
    booked = {(m["node"], m["index"]) for n in "abc" for m in cluster.status(n)["memory"]}
    assert booked == {("gpu-a", 0), ("gpu-a", 1)}
    for p in cluster.objects(PODS):  # bind the replica pods too: they request no nvidia.com/gpu
        if not rsv.is_reservation(p):
            assert rsv.gpu_requests(p) == 0
            p["spec"]["nodeName"] = "gpu-a"
    node_obj = cluster.get("v1/nodes", "gpu-a", None)
    assert rsv.free_for_others(node_obj, cluster.objects(PODS)) == 4 - len(booked) == 2
    held = {p["metadata"]["annotations"][rsv.ANNOTATION_UUID] for p in reservations(cluster)}
    assert held == {U[0], U[1]}  # exactly the GPUs vllmfit's replicas use, each held once


async def test_a_reservation_that_gets_another_gpu_rebooks_the_replicas_there(
        cluster: Cluster, operator: Operator) -> None:
    await cluster.create(gpu_node("gpu-a", 2))
    await cluster.create(vd("a", QWEN7, placement={"nodeName": "gpu-a", "gpuIndices": [1]}))
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: asked(cluster) == [("gpu-a", 1)])
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    assert visible(cluster, "a-0") == U[1]
    dp = DevicePlugin(cluster, {"gpu-a": U[:2]})  # the plugin's first free GPU is 0
    assert await dp.serve() == [U[0]]
    await cluster.until(lambda: cluster.status("a")["gpuList"] == "0", what="a re-booked on GPU 0")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and visible(cluster, "a-0") == U[0],
                        what="a pinned to GPU 0")  # a move stops the replica, then writes it again
    st = cluster.status("a")
    assert [(m["node"], m["index"]) for m in st["memory"]] == [("gpu-a", 0)]
    assert st["placement"][0]["gpus"][0]["uuid"] == U[0]
    await cluster.event("a", "Rebooked")
    await settle(cluster)
    assert len(reservations(cluster)) == 1  # the one that got GPU 0 now holds a's GPU; none for GPU 1
    pod = await replica_pod(cluster, "a-0")
    await cluster.until(lambda: gates(cluster, pod) == [])


async def test_the_last_replica_leaving_a_gpu_takes_its_reservation_away(cluster: Cluster,
                                                                         operator: Operator) -> None:
    await shared_pair(cluster, gpu=0)
    await cluster.until(lambda: len(reservations(cluster)) == 1)
    await DevicePlugin(cluster, {"gpu-a": U[:2]}).serve()
    await cluster.delete("a")
    await cluster.until(lambda: cluster.get(VD, "a") is None)
    await settle(cluster)
    assert len(reservations(cluster)) == 1  # b still uses GPU 0
    await cluster.delete("b")
    await cluster.until(lambda: reservations(cluster) == [], what="the reservation to go")


async def test_gfd_only_node_learns_the_uuid_from_the_reservation(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(gpu_node("gpu-g", 2, agent=False))
    await cluster.create(vd("a", QWEN7, placement={"nodeName": "gpu-g", "gpuIndices": [0]}))
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    assert visible(cluster, "a-0") == "void"  # which GPU is not known before the reservation reports
    await cluster.until(lambda: asked(cluster) == [("gpu-g", 0)])
    assert await DevicePlugin(cluster, {"gpu-g": U[2:4]}).serve() == [U[2]]
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and visible(cluster, "a-0") == U[2],
                        what="a pinned to the reported GPU")
    pod = await replica_pod(cluster, "a-0")
    await cluster.until(lambda: gates(cluster, pod) == [])


async def test_restart_between_reservation_and_report_and_after_a_mismatch(km: Any, cluster: Cluster) -> None:
    op = Operator(km)
    await op.start()
    await cluster.create(gpu_node("gpu-a", 2))
    await cluster.create(vd("a", QWEN7, placement={"nodeName": "gpu-a", "gpuIndices": [1]}))
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: asked(cluster) == [("gpu-a", 1)])
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    pod = await replica_pod(cluster, "a-0")
    await op.stop()
    await cluster.reconnect()
    # while the operator is down, the device plugin hands the reservation GPU 0
    assert await DevicePlugin(cluster, {"gpu-a": U[:2]}).serve() == [U[0]]
    op = Operator(km)
    await op.start()
    try:
        await cluster.until(lambda: cluster.status("a")["gpuList"] == "0", what="re-booked after the restart")
        await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and visible(cluster, "a-0") == U[0])
        await settle(cluster)
        assert asked(cluster) == [("gpu-a", 1)]  # the same pod, no second reservation
        # pinned to GPU 1: never let through (a bare pod at a place no booking covers: the sweep of
        # the new leader may also have deleted it)
        assert gates(cluster, pod) == [{"name": rsv.GATE}] or cluster.get(PODS, pod) is None
        new = await replica_pod(cluster, "a-0")
        await cluster.until(lambda: gates(cluster, new) == [])
        await op.stop()
        await cluster.reconnect()
        op = Operator(km)
        await op.start()  # a second restart changes nothing
        await settle(cluster)
        assert cluster.status("a")["gpuList"] == "0" and len(reservations(cluster)) == 1
        assert cluster.store.books.ledger.deployments() == ["default/a"]
    finally:
        await op.stop()


async def test_a_reservation_the_scheduler_cannot_place_is_explained(cluster: Cluster, operator: Operator) -> None:
    """Another pod took the node's last free GPU first: the reservation stays Pending, the
    replica stays gated, and the deployment says why in the scheduler's words."""
    await cluster.create(gpu_node("gpu-a", 2))
    await cluster.create(vd("a", QWEN7, placement={"nodeName": "gpu-a", "gpuIndices": [0]}))
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: len(reservations(cluster)) == 1)
    [res] = reservations(cluster)
    message = "0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node affinity/selector."
    await cluster.patch_pod(res["metadata"]["name"], {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}})
    await cluster.until(lambda: any(e["reason"] == "ReservationPending" and message in e["message"]
                                    for e in cluster.events("a")), what="the ReservationPending event")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    pod = await replica_pod(cluster, "a-0")
    await cluster.until(lambda: ("default", pod) in cluster.store.cache.gated or not gates(cluster, pod))
    assert gates(cluster, pod) == [{"name": rsv.GATE}]


async def test_a_neighbour_of_a_whole_node_replica_needs_no_reservation_even_after_a_restart(
        km: Any, cluster: Cluster) -> None:
    """`first` holds the 1-GPU node with a device-plugin limit; `second` shares that GPU: the
    limit holds it, so no reservation (it could never be scheduled) and no gate, also when the
    restarted operator resumes `second` before `first`."""
    op = Operator(km)
    await op.start()
    try:
        await cluster.create(gpu_node("gpu-a", 1))
        await cluster.create(vd("first", QWEN7))
        await cluster.phase("first", "Admitted")
        await cluster.until(lambda: cluster.get(DEPLOYMENTS, "first-0"))
        await cluster.create(vd("second", QWEN7, maxModelLen=8192))
        await cluster.phase("second", "Admitted")
        await cluster.until(lambda: cluster.get(DEPLOYMENTS, "second-0"))
        await settle(cluster)
        assert "schedulingGates" not in cluster.get(DEPLOYMENTS, "second-0")["spec"]["template"]["spec"]
        await op.stop()
        await cluster.reconnect()
        op = Operator(km)
        await op.start()
        await cluster.until(lambda: ("default/first", 0) in cluster.store.cache.whole, what="the whole-node holder read back")
        await settle(cluster)
        for name in ("second-0", "first-0"):
            assert "schedulingGates" not in cluster.get(DEPLOYMENTS, name)["spec"]["template"]["spec"]
        posted = [r.data for r in km.sent("post", PODS) if isinstance(r.data, dict) and rsv.is_reservation(r.data)]
        assert posted == [] and reservations(cluster) == []
        # the limit goes with `first`: `second`'s GPU gets a reservation, and `second` is not restarted
        before = cluster.get(DEPLOYMENTS, "second-0")["spec"]
        await cluster.delete("first")
        await cluster.until(lambda: asked(cluster) == [("gpu-a", 0)], what="a reservation for second's GPU")
        await settle(cluster)
        assert cluster.get(DEPLOYMENTS, "second-0")["spec"] == before
    finally:
        await op.stop()


async def test_sharing_replicas_are_written_where_their_runtime_class_exists(cluster: Cluster,
                                                                             operator: Operator) -> None:
    await shared_pair(cluster)
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and cluster.get(DEPLOYMENTS, "b-0"))
    assert cluster.get(DEPLOYMENTS, "a-0")["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    assert not any(e["reason"] == "RuntimeClassNotFound" for n in "ab" for e in cluster.events(n))


async def test_sharing_replicas_are_refused_where_their_runtime_class_does_not_exist(km: Any,
                                                                                    cluster: Cluster) -> None:
    """GKE has no `nvidia` RuntimeClass: a pod naming it never starts. The replicas that need it
    are not written; the deployment says why, in kube-scheduler-like words (issue 21). Once the
    RuntimeClass is created they are written."""
    op = Operator(km, runtime_classes=())
    await op.start()
    try:
        await shared_pair(cluster)
        want = ("runtimeClass 'nvidia' does not exist in the cluster: replicas that share a GPU through "
                "NVIDIA_VISIBLE_DEVICES need it (chart value placement.reservation.runtimeClassName; empty where "
                "the NVIDIA runtime is the nodes' default)")
        for n in "ab":
            await cluster.until(lambda n=n: any(e["reason"] == "RuntimeClassNotFound" for e in cluster.events(n)),
                                what=f"{n}: a RuntimeClassNotFound Event")
            assert [e["message"] for e in cluster.events(n) if e["reason"] == "RuntimeClassNotFound"] == [want]
            await cluster.until(lambda n=n: (cluster.status(n).get("conditions") or []) and next(
                c for c in cluster.status(n)["conditions"] if c["type"] == "Placed")["reason"] == "RuntimeClassNotFound",
                what=f"{n}: the Placed condition")
        assert cluster.get(DEPLOYMENTS, "a-0") is None and cluster.get(DEPLOYMENTS, "b-0") is None
        await client.NodeV1Api(cluster.api).create_runtime_class(
            {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
             "handler": "nvidia"})
        await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") and cluster.get(DEPLOYMENTS, "b-0"),
                            what="the replicas once the RuntimeClass exists")
    finally:
        await op.stop()
