"""A booking lives as long as the memory is used (issue 22, item 1): a replica's memory stays
booked until every pod that could hold it is gone from the API (deleted and its containers
terminated), on delete, scale-down and move; a newcomer waits for it.

KMock runs no controllers, so the tests play the kubelet: they create the replica's pod (as a
ReplicaSet would, with the placement annotation the Deployment's template carries) and delete it
when they decide its containers have terminated.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from bookkit import child
from opkit import DEPLOYMENTS, PODS, Cluster, Operator, node, vd

from vllmfit.operator.handlers.writes import settle_drains
from vllmfit.operator.rendering import builders

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
BIG = {"maxModelLen": 32768, "kvCache": {"concurrency": 16}}  # more than half of an H100's budget


async def pod_of(cluster: Cluster, deployment: str) -> str:
    """The pod a ReplicaSet would create for Deployment `deployment` (as the kubelet runs it)."""
    d = await cluster.until(lambda: cluster.get(DEPLOYMENTS, deployment), what=f"Deployment {deployment}")
    tmpl = d["spec"]["template"]
    name = f"{deployment}-{uuid.uuid4().hex[:5]}"
    await cluster.create({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4()), "resourceVersion": "1",
                     "labels": dict(tmpl["metadata"]["labels"]), "annotations": dict(tmpl["metadata"]["annotations"]),
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{deployment}-rs",
                                          "uid": str(uuid.uuid4()), "controller": True}]},
        "spec": {"nodeName": "gpu-a", "containers": tmpl["spec"]["containers"]},
        "status": {"phase": "Running"},
    })
    return name


async def gone(cluster: Cluster, pod: str) -> None:
    """The kubelet reports the containers terminated: the pod leaves the API."""
    await cluster.core.delete_namespaced_pod(pod, "default")


async def waits_for(cluster: Cluster, name: str, pod: str) -> None:
    """`name` stays Unschedulable while `pod` (an old vLLM still holding the GPU) is there, and is
    admitted once the kubelet reports it gone."""
    await stays(cluster, name, "Unschedulable")
    await gone(cluster, pod)
    await cluster.phase(name, "Admitted")


async def stays(cluster: Cluster, name: str, phase: str) -> None:
    """`name` keeps `phase` while the old pod is there. No wall time: once the operator holds the
    stopped replica's memory (its drain) and is caught up (every status written), the step that
    would free the room runs (writes.settle_drains lists the stopped replicas' pods; the old one
    is listed), and the phase is unchanged."""
    store = cluster.store
    await cluster.until(lambda: any(d.stopped for d in store.books.drains.values()),
                        what="the operator to hold the stopped replica's memory (its drain)")
    await store.writer.flush()
    await settle_drains(store)
    await store.writer.flush()
    assert cluster.status(name).get("phase") == phase, \
        f"{name} became {cluster.status(name).get('phase')} while the old pod still held the GPU"


async def test_a_deleted_deployment_stays_booked_until_its_pod_is_gone(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("a", QWEN7, **BIG))
    await cluster.phase("a", "Admitted")
    pod = await pod_of(cluster, "a-0")
    await cluster.create(vd("b", QWEN7, **BIG))
    await cluster.phase("b", "Unschedulable")
    await cluster.delete("a")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") is None, what="a-0 deleted")
    await waits_for(cluster, "b", pod)  # a's vLLM is still terminating on the GPU


async def test_a_scale_down_keeps_the_replica_booked_until_its_pod_is_gone(cluster: Cluster,
                                                                           operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(vd("a", QWEN7, replicas=2, **BIG))
    await cluster.phase("a", "Admitted")
    pod = await pod_of(cluster, "a-1")
    await cluster.create(vd("b", QWEN7, **BIG))
    await cluster.phase("b", "Unschedulable")
    await cluster.patch_spec("a", {"replicas": 1})
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-1") is None, what="a-1 deleted")
    await waits_for(cluster, "b", pod)


async def test_a_scale_down_stops_the_replica_before_its_status_releases_it(cluster: Cluster,
                                                                              operator: Operator) -> None:
    """The status (the booking the API keeps) shrinks only after the replica's Deployment is gone."""
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(vd("a", QWEN7, replicas=2, **BIG))
    await cluster.phase("a", "Admitted")
    n = len(cluster.km.journal)
    await cluster.patch_spec("a", {"replicas": 1})
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-1") is None and len(cluster.status("a")["placement"]) == 1,
                        what="a scaled to 1")
    later = list(cluster.km.journal)[n:]
    order = [i for i, r in enumerate(later) if str(r.method).upper().endswith("DELETE") and "a-1" in str(r.url)]
    status = [i for i, r in enumerate(later) if str(r.method).upper().endswith("PATCH") and "/status" in str(r.url)
              and len(((r.data or {}).get("status") or {}).get("placement") or [1, 2]) == 1]
    assert order and status and order[0] < status[0], (order, status)


def labels_of(pod: dict[str, Any]) -> dict[str, str]:
    return pod["metadata"].get("labels") or {}


async def test_the_pods_carry_the_placement_the_evidence_is_read_from(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("a", QWEN7))
    await cluster.phase("a", "Admitted")
    name = await pod_of(cluster, "a-0")
    pod = cluster.get(PODS, name)
    assert labels_of(pod)[builders.LABEL_DEPLOYMENT] == "a" and labels_of(pod)[builders.LABEL_REPLICA] == "0"
    assert pod["metadata"]["annotations"][builders.ANNOTATION_PLACEMENT] == "gpu-a:0"


async def test_a_lost_reservation_is_reported_and_asked_again_and_a_failed_one_is_replaced(
        cluster: Cluster, operator: Operator) -> None:
    from reservationkit import asked, reservations, shared_pair

    await shared_pair(cluster)  # two on one GPU: a reservation
    await cluster.until(lambda: asked(cluster) == [("gpu-a", 1)], what="a reservation for gpu-a GPU 1")
    first = reservations(cluster)[0]["metadata"]["name"]
    await cluster.core.delete_namespaced_pod(first, "default")  # evicted, preempted, or a kubectl delete
    event = await cluster.event("a", "ReservationLost")
    assert f"{first} holding gpu-a GPU 1 was deleted, evicted or preempted" in event["message"]
    await cluster.until(lambda: asked(cluster) == [("gpu-a", 1)], what="the same GPU asked for again")
    second = reservations(cluster)[0]["metadata"]["name"]
    await cluster.patch_pod(second, {"status": {"phase": "Failed"}})
    await cluster.until(lambda: all(r["metadata"]["name"] != second or (r.get("status") or {}).get("phase") != "Failed"
                                    for r in reservations(cluster)) and asked(cluster) == [("gpu-a", 1)],
                        what="the failed reservation replaced")
    assert [e for e in cluster.events("b") if e.get("reason") == "ReservationLost" and "failed" in e["message"]]


async def test_a_gracefully_evicted_reservation_is_reported_when_its_deletion_starts(
        cluster: Cluster, operator: Operator) -> None:
    """On a real API server an eviction or `kubectl delete` first sets a deletionTimestamp (the
    pod terminates for its grace period); the first event already shows it terminating. It is
    lost then, not when the pod leaves the API (KMock keeps a deleted pod while it has a
    finalizer, as the API server keeps it until the kubelet says its containers stopped)."""
    from reservationkit import asked, reservations, shared_pair

    await shared_pair(cluster)
    await cluster.until(lambda: asked(cluster) == [("gpu-a", 1)], what="a reservation for gpu-a GPU 1")
    first = reservations(cluster)[0]["metadata"]["name"]
    await cluster.patch_pod(first, {"metadata": {"finalizers": ["tests/kubelet"]}})
    await cluster.core.delete_namespaced_pod(first, "default")
    assert cluster.get(PODS, first)["metadata"].get("deletionTimestamp")
    event = await cluster.event("a", "ReservationLost")
    assert f"{first} holding gpu-a GPU 1 was deleted, evicted or preempted" in event["message"]


# --- restart: what a status may book (store level) -------------------------------------------------


def _restart_inputs() -> tuple[dict[str, Any], dict[str, Any]]:
    from bookkit import admitted_status, body
    from bookkit import node as bare_node

    from vllmfit.operator.booking.state import Store

    live = Store()
    live.rebuild([bare_node("gpu-a", 1)], [])
    st = admitted_status(live, "a")
    return body("a", st), bare_node("gpu-a", 1)


def test_a_status_alone_books_nothing_at_restart() -> None:
    """A forged Admitted status (or one whose Deployment was never written) is not restored: the
    deployment is decided again. With its Deployment owned by it at the booked place, it is."""
    from vllmfit.operator.booking.state import Store

    a, gpu = _restart_inputs()
    for children, booked in (([], False), ([child(a, "gpu-a:0", uid="someone-else")], False),
                             ([child(a, "gpu-a:1")], False), ([child(a, "gpu-a:0")], True)):
        s = Store()
        problems = s.rebuild([gpu], [a], children, [])
        assert bool(s.books.ledger.bookings_of("ns/a")) is booked, children
        assert s.cache.records["ns/a"].admitted is booked
        assert booked or any("not restored" in p for p in problems)


def test_a_pod_nothing_books_is_a_drain_at_restart_until_it_is_gone() -> None:
    from vllmfit.operator.booking import draining
    from vllmfit.operator.booking.state import Store

    a, gpu = _restart_inputs()
    pod = child(a, "gpu-a:0") | {"status": {"phase": "Running"}}
    s = Store()
    s.rebuild([gpu], [a], [], [pod])  # its Deployment is gone, its pod still terminates
    [d] = s.books.drains.values()
    assert (d.key, d.replica, d.where, d.stopped) == ("ns/a", 0, "gpu-a:0", True)
    assert s.books.ledger.headroom_bytes("gpu-a", 0) == 0  # nothing else fits beside it
    assert draining.ended(s.books.drains, "ns", "a", [pod]) == []
    assert draining.ended(s.books.drains, "ns", "a", []) == [d.name]
    done = pod | {"status": {"phase": "Succeeded"}}
    assert draining.ended(s.books.drains, "ns", "a", [done]) == [d.name]


def test_refused_node_data_at_restart_moves_nothing() -> None:
    """Bad node data at start-up degrades as it does live: what is booked there stays."""
    from vllmfit.operator.booking.state import Store

    a, gpu = _restart_inputs()
    bad = {"metadata": {"name": "gpu-a", "labels": {**gpu["metadata"]["labels"], "nvidia.com/gpu.count": "nan"}}}
    s = Store()
    problems = s.rebuild([bad], [a], [child(a, "gpu-a:0")], [])
    assert problems and "gpu-a" in s.books.refused
    assert s.books.ledger.bookings_of("ns/a") and not s.books.misplaced("ns/a")


async def test_a_booking_whose_status_cannot_be_written_because_the_object_is_gone_starts_nothing(
        km: Any, cluster: Cluster) -> None:
    """404 on the status write that books a deployment is a failed write, not success: its
    Deployment is not written (the object was deleted between the decision and the write)."""
    from bookkit import body as vd_body
    from bookkit import node as bare_node
    from kubernetes_asyncio import client
    from opkit import km_url

    from vllmfit.core import placement
    from vllmfit.operator.booking.state import Store
    from vllmfit.operator.handlers import common, decide, writes
    from vllmfit.sources import catalog

    store = Store()  # no operator runs: the test is its one handler
    store.api = client.ApiClient(client.Configuration(host=km_url(km)))
    try:
        store.rebuild([bare_node("gpu-a", 1)], [])
        obj = vd_body("gone", kvCache={"concurrency": 1})  # never created in the API (or deleted since)
        rec = store.cache.upsert(obj)
        req = placement.request_from_object(common.parse(obj), catalog.model(QWEN7))
        fx = common.Effects()
        async with store.books.transaction(counted=False):
            decide.apply_decision(store, rec, req, placement.decide(store.books.ledger, req), fx)
        assert rec.admitted and fx.sync == {"ns/gone"}
        await writes.finish(store, fx, strict=False, hold=False)
        assert cluster.get(DEPLOYMENTS, "gone-0", ns="ns") is None
    finally:
        await store.api.close()


MID = {"maxModelLen": 32768, "kvCache": {"concurrency": 8}}  # fits beside SMALL, not beside BIG
SMALL = {"maxModelLen": 8192, "kvCache": {"concurrency": 1}}


def booked_total(cluster: Cluster, name: str) -> int:
    return sum(m["totalBytes"] for m in cluster.status(name).get("memory") or [])


async def test_a_resize_in_place_keeps_the_difference_booked_until_the_old_pod_is_gone(
        cluster: Cluster, operator: Operator) -> None:
    """A change of flags that keeps a replica on its GPU (a resize in place) is a rolling update
    of the same Deployment (Recreate): the old pod keeps the old footprint until it is gone. What
    the smaller footprint frees stays booked (a drain of the difference) until then."""
    from opkit import budget

    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("a", QWEN7, **BIG))
    await cluster.phase("a", "Admitted")
    old = await pod_of(cluster, "a-0")
    big = booked_total(cluster, "a")
    await cluster.create(vd("b", QWEN7, **MID))
    await cluster.phase("b", "Unschedulable")
    await cluster.patch_spec("a", {**SMALL})
    await cluster.until(lambda: 0 < booked_total(cluster, "a") < big, what="a resized in place")
    assert [p["node"] for p in cluster.status("a")["placement"]] == ["gpu-a"]
    small = booked_total(cluster, "a")
    await cluster.until(lambda: (cluster.get(DEPLOYMENTS, "a-0") or {}).get("spec", {}).get("template", {})
                        .get("metadata", {}).get("annotations", {}) != cluster.get(PODS, old)["metadata"]["annotations"]
                        or cluster.get(DEPLOYMENTS, "a-0")["spec"]["template"]["spec"]["containers"][0]["args"]
                        != cluster.get(PODS, old)["spec"]["containers"][0]["args"], what="a-0 rewritten")
    await waits_for(cluster, "b", old)  # a's old vLLM still holds the old footprint
    # the scenario tests what it says: b fits beside the new footprint, not beside the old one
    assert small + booked_total(cluster, "b") <= budget() < big + booked_total(cluster, "b")
