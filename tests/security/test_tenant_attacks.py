"""Tenant attacks (issue 21) against the real operator on the KMock emulator: what a tenant who
may create pods and VLLMDeployments in its own namespace can try, and that none of it forges,
widens or stalls a booking.

- forged reservations: a pod in the tenant's namespace with the reservation labels, annotations
  and a reported UUID, under the name of the real reservation; and one in the operator's
  namespace made by another controller;
- each GPU escape of item 2 and a poison template, sent past the webhook (failurePolicy Ignore,
  or a webhook that is down): the operator refuses them itself and keeps serving the others;
- a lookalike bare pod in a namespace the operator may not delete from (403): the sweep goes on.

Written first and run on the old code: the forged reservation opened the real replica's gate and
its deletion dropped the real reservation's record; the escapes were admitted with Deployments
that carried them; the poison template raised AttributeError in every batch; the 403 aborted the
sweep."""

from __future__ import annotations

import uuid as uuidlib
from typing import Any

import kmock
import pytest
from kubernetes_asyncio import client
from opkit import DEPLOYMENTS, H100, PODS, Cluster, Operator, node, vd
from reservationkit import replica_pod

from vllmfit.backends import reservation as rsv
from vllmfit.core import defaults
from vllmfit.operator.binding import reservations as reservations_mod
from vllmfit.operator.handlers.sweep import sweep

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
U = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(4)]


def inventory(uuids: list[str]) -> dict[str, str]:
    import json
    gpus = [{"index": i, "uuid": u, "product": H100, "totalBytes": 81559 << 20, "usedBytes": 0}
            for i, u in enumerate(uuids)]
    return {defaults.INVENTORY_ANNOTATION: json.dumps(
        {"schemaVersion": 1, "nvml": True, "sampledAt": "2999-01-01T00:00:00Z", "gpus": gpus})}


def gpu_node(name: str, n: int) -> dict[str, Any]:
    obj = node(name, gpus=n, annotations=inventory(U[:n]))
    obj["status"]["allocatable"] = {"nvidia.com/gpu": str(n)}
    return obj


def real_reservations(cluster: Cluster) -> list[dict[str, Any]]:
    ns = cluster.store.options.reservation.namespace
    return [p for p in cluster.objects(PODS, ns) if rsv.is_reservation(p)]


def gates(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    return (cluster.get(PODS, name) or {}).get("spec", {}).get("schedulingGates") or []


def forged(name: str, ns: str, node_name: str, index: int, uuid: str, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "uid": str(uuidlib.uuid4()), "resourceVersion": "1",
                         "labels": {rsv.MANAGED_BY: "vllmfit", rsv.ROLE_LABEL: rsv.ROLE},
                         "annotations": {rsv.ANNOTATION_NODE: node_name, rsv.ANNOTATION_INDEX: str(index),
                                         rsv.ANNOTATION_UUID: uuid}, **meta},
            "spec": {"nodeName": node_name, "containers": [{"name": "x", "image": "busybox"}]},
            "status": {"phase": "Running"}}


async def test_a_forged_reservation_holds_nothing_and_cannot_drop_the_real_one(
        cluster: Cluster, operator: Operator) -> None:
    await cluster.create(gpu_node("gpu-a", 2))
    await cluster.create(vd("a", QWEN7, placement={"nodeName": "gpu-a", "gpuIndices": [1]}))
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: len(real_reservations(cluster)) == 1, what="the real reservation")
    [real] = real_reservations(cluster)
    name = real["metadata"]["name"]
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    pod = await replica_pod(cluster, "a-0", owned=True)
    await cluster.until(lambda: ("default", pod) in cluster.store.cache.gated, what="the replica pod to be gated")
    # The tenant forges the reservation: its name, labels, annotations and the booked GPU's UUID.
    fake = forged(name, "tenant-a", "gpu-a", 1, U[1])
    await cluster.create(fake)
    await cluster.until(lambda: cluster.get(PODS, name, "tenant-a"))
    await cluster.store.writer.flush()
    await cluster.until(lambda: cluster.store.cache.reservations.get(name) is None  # (old code: it took the forgery's UUID)
                        or cluster.store.cache.reservations[name].uuid is None, timeout=1.0, what="nothing reported")
    assert gates(cluster, pod) == [{"name": rsv.GATE}]  # nothing opened by the forgery
    assert cluster.store.cache.reservations[name].uuid is None  # the real one has not reported yet
    ev = await cluster.event(name, "NotAReservation")
    assert ev["involvedObject"]["namespace"] == "tenant-a" and "tenant-a" in ev["message"]
    assert reservations_mod.LOOKALIKE_REASON == "NotAReservation"
    # Deleting the forgery (same name) drops nothing: the real reservation stays known and held.
    await cluster.core.delete_namespaced_pod(name, "tenant-a")
    await cluster.store.writer.flush()
    assert name in cluster.store.cache.reservations
    assert [p["metadata"]["name"] for p in real_reservations(cluster)] == [name]
    # The real one reports: the gate opens.
    await cluster.patch_pod(name, {"metadata": {"annotations": {rsv.ANNOTATION_UUID: U[1]}},
                                   "spec": {"nodeName": "gpu-a"}, "status": {"phase": "Running"}},
                            ns=cluster.store.options.reservation.namespace)
    await cluster.until(lambda: gates(cluster, pod) == [], what="the gate to open for the real report")


async def test_a_lookalike_made_by_another_controller_in_vllmfits_namespace_is_ignored(
        cluster: Cluster, operator: Operator) -> None:
    await cluster.create(gpu_node("gpu-a", 2))
    ns = cluster.store.options.reservation.namespace
    owner = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "x", "uid": "x", "controller": True}]
    await cluster.create(forged("vllmfit-gpu-x-0", ns, "gpu-a", 0, U[0], ownerReferences=owner))
    await cluster.event("vllmfit-gpu-x-0", "NotAReservation")
    assert "vllmfit-gpu-x-0" not in cluster.store.cache.reservations


ESCAPES: list[tuple[str, dict[str, Any], str]] = [
    ("sidecar-all", {"containers": [{"name": "p", "image": "cuda", "env": [{"name": "NVIDIA_VISIBLE_DEVICES",
                                                                           "value": "all"}]}]},
     "env[NVIDIA_VISIBLE_DEVICES]"),
    ("privileged", {"containers": [{"name": "p", "image": "i", "securityContext": {"privileged": True}}]},
     "securityContext.privileged"),
    ("mig-sidecar", {"initContainers": [{"name": "p", "image": "i", "resources": {"limits": {
        "nvidia.com/mig-1g.10gb": 1}}}]}, "resources.limits[nvidia.com/mig-1g.10gb]"),
    ("hostpid", {"hostPID": True}, "podTemplate.spec.hostPID"),
    ("devmount", {"volumes": [{"name": "d", "hostPath": {"path": "/dev"}}]}, "hostPath.path '/dev'"),
]


async def test_escapes_and_poison_past_the_webhook_are_refused_by_the_operator_which_keeps_serving(
        cluster: Cluster, operator: Operator) -> None:
    await cluster.create(gpu_node("gpu-a", 2))
    for name, spec, _ in ESCAPES:
        await cluster.create(vd(name, QWEN7, maxModelLen=4096, podTemplate={"spec": spec}))
    await cluster.create(vd("poison", QWEN7, maxModelLen=4096, podTemplate={"spec": {"affinity": "x"}}))
    await cluster.create(vd("poison2", QWEN7, maxModelLen=4096, podTemplate={"spec": {"tolerations": 7}}))
    await cluster.create(vd("good", QWEN7, maxModelLen=4096))
    for name, _, field in ESCAPES:
        st = await cluster.phase(name, "Rejected")
        assert field in st["conditions"][0]["message"] or any(field in c.get("message", "") for c in st["conditions"])
        assert cluster.get(DEPLOYMENTS, f"{name}-0") is None
    for name, text in (("poison", "podTemplate.spec.affinity must be an object"),
                       ("poison2", "podTemplate.spec.tolerations must be a list")):
        st = await cluster.phase(name, "Rejected")
        assert any(text in c.get("message", "") for c in st["conditions"])
    await cluster.phase("good", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "good-0"), what="the good spec's Deployment")


async def test_the_sweep_goes_on_past_an_object_it_may_not_delete(
        cluster: Cluster, operator: Operator, km: Any) -> None:
    await cluster.create(gpu_node("gpu-a", 1))
    labels = {"app.kubernetes.io/managed-by": "vllmfit", "vllmfit.dev/deployment": "ghost",
              "vllmfit.dev/replica": "0"}
    for ns in ("locked", "open"):
        await cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "ghost-0", "namespace": ns, "uid": str(uuidlib.uuid4()), "resourceVersion": "1",
            "labels": dict(labels)}, "spec": {"containers": [{"name": "x", "image": "i"}]}})
    km["delete", kmock.resource("v1/pods"), kmock.namespace("locked")] << 403 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": "pods \"ghost-0\" is forbidden"}
    gone = await sweep(cluster.store)
    assert gone == ["Pod open/ghost-0"]  # the 403 in "locked" is logged and skipped; "open" is swept


@pytest.mark.parametrize("status", [403, 404])
async def test_a_sweep_answer_about_one_deployment_stops_nothing(
        cluster: Cluster, operator: Operator, km: Any, status: int) -> None:
    labels = {"app.kubernetes.io/managed-by": "vllmfit", "vllmfit.dev/deployment": "ghost", "vllmfit.dev/replica": "0"}
    for ns in ("locked", "open"):
        await client.AppsV1Api(cluster.api).create_namespaced_deployment(ns, {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "ghost-0", "namespace": ns, "uid": str(uuidlib.uuid4()), "resourceVersion": "1",
                         "labels": dict(labels)},
            "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
                "containers": [{"name": "x", "image": "i"}]}}}})
    km["get", kmock.resource("apps/v1/deployments"), kmock.namespace("locked")] << status << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status}
    gone = await sweep(cluster.store)
    assert gone == ["Deployment open/ghost-0"]
