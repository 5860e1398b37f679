"""GPU nodes with the agent's inventory, the reservation pods vllmfit asked for, and the pod a
ReplicaSet would create, a device plugin that hands reservations their GPUs, and a shared pair of
deployments: shared by test_reservations.py, test_dra.py, test_lifecycle.py and test_closed_loop.py
(a helpers module: test modules never import each other)."""

from __future__ import annotations

import json
import uuid as uuidlib
from typing import Any

from opkit import DEPLOYMENTS, H100, PODS, Cluster, node, vd

from vllmfit.backends import reservation as rsv
from vllmfit.core import defaults

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
U = [f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-4000-8000-00000000000{i}" for i in range(4)]


def inventory(uuids: list[str]) -> dict[str, str]:
    inv = {"sampled_at": "2030-01-01T00:00:00Z", "nvml": True, "gpus": [
        {"index": i, "uuid": u, "product": H100, "total_bytes": 81559 * defaults.MIB, "used_bytes": 0}
        for i, u in enumerate(uuids)]}
    return {defaults.INVENTORY_ANNOTATION: json.dumps(inv)}


def gpu_node(name: str, n: int, *, agent: bool = True) -> dict[str, Any]:
    obj = node(name, gpus=n, annotations=inventory(U[:n]) if agent else None)
    obj["status"]["allocatable"] = {"nvidia.com/gpu": str(n)}
    return obj


def reservations(cluster: Cluster) -> list[dict[str, Any]]:
    return sorted((p for p in cluster.objects(PODS) if rsv.is_reservation(p)), key=lambda p: p["metadata"]["name"])


def asked(cluster: Cluster) -> list[tuple[str, int]]:
    return sorted((p["metadata"]["annotations"][rsv.ANNOTATION_NODE], int(p["metadata"]["annotations"][
        rsv.ANNOTATION_INDEX])) for p in reservations(cluster))


async def replica_pod(cluster: Cluster, deployment: str, *, owned: bool = False) -> str:
    """The pod the ReplicaSet controller would create from the Deployment's template (`owned`:
    with the ownerReference to its ReplicaSet that the controller sets)."""
    d = cluster.get(DEPLOYMENTS, deployment)
    tpl = d["spec"]["template"]
    name = f"{deployment}-{uuidlib.uuid4().hex[:5]}"
    owner = {"ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{deployment}-rs",
                                  "uid": "rs", "controller": True}]} if owned else {}
    await cluster.create({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": name, "namespace": "default", "uid": str(uuidlib.uuid4()),
                                       "resourceVersion": "1", "labels": dict(tpl["metadata"]["labels"]),
                                       "annotations": dict(tpl["metadata"].get("annotations") or {}), **owner},
                          "spec": json.loads(json.dumps(tpl["spec"])), "status": {"phase": "Pending"}})
    return name


class DevicePlugin:
    """Hands each unbound reservation pod a free GPU of its node (first free in `order`) and
    reports it as the reservation container would: its own pod's annotation."""

    def __init__(self, cluster: Cluster, uuids: dict[str, list[str]], order: dict[str, list[int]] | None = None):
        self.cluster, self.uuids, self.order = cluster, uuids, order or {}

    def held(self, node_name: str) -> set[str]:
        return {p["metadata"]["annotations"].get(rsv.ANNOTATION_UUID) for p in reservations(self.cluster)
                if p["spec"].get("nodeName") == node_name} - {None}

    async def serve(self) -> list[str]:
        given = []
        for p in reservations(self.cluster):
            if p["spec"].get("nodeName"):
                continue
            n = p["metadata"]["annotations"][rsv.ANNOTATION_NODE]
            free = [i for i in self.order.get(n, range(len(self.uuids[n]))) if self.uuids[n][i] not in self.held(n)]
            u = self.uuids[n][free[0]]
            await self.cluster.patch_pod(p["metadata"]["name"], {
                "metadata": {"annotations": {rsv.ANNOTATION_UUID: u}},
                "spec": {"nodeName": n}, "status": {"phase": "Running"}})
            given.append(u)
        return given


def gates(cluster: Cluster, pod: str) -> list[dict[str, Any]]:
    return (cluster.get(PODS, pod) or {}).get("spec", {}).get("schedulingGates") or []


async def shared_pair(cluster: Cluster, gpu: int = 1) -> None:
    """a and b admitted on gpu-a GPU `gpu` of two: a shared GPU, held by one reservation."""
    await cluster.create(gpu_node("gpu-a", 2))
    pin = {"nodeName": "gpu-a", "gpuIndices": [gpu]}
    await cluster.create(vd("a", QWEN7, placement=pin))
    await cluster.create(vd("b", QWEN7, maxModelLen=8192, placement=pin))
    await cluster.phase("a", "Admitted")
    await cluster.phase("b", "Admitted")
