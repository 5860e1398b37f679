"""GPU nodes with the agent's inventory, the reservation pods vllmfit asked for, and the pod a
ReplicaSet would create: shared by test_reservations.py and test_dra.py (a helpers module: test
modules never import each other)."""

from __future__ import annotations

import json
import uuid as uuidlib
from typing import Any

from opkit import DEPLOYMENTS, H100, PODS, Cluster, node

from vllmfit.backends import reservation as rsv
from vllmfit.core import defaults

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
