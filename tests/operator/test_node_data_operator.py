"""Bad node data on the emulator (issue 14, item 1): a node whose inventory annotation or GPU
count label turns malformed keeps its last good state. Nothing on it becomes Unschedulable or
loses its Deployment; its deployments get a NodeData condition and an Event, and the metric
vllmfit_node_data_refused_total counts it. Fixing the data clears the condition."""

from __future__ import annotations

import json
from typing import Any

import pytest
from opkit import DEPLOYMENTS, H100, Cluster, Operator, node, vd
from prometheus_client import REGISTRY

from vllmfit.core import defaults

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"


def inventory(**gpu: Any) -> dict[str, str]:
    inv = {"sampled_at": "2030-01-01T00:00:00Z", "nvml": True, "gpus": [
        {"index": i, "uuid": f"GPU-a{i}", "product": H100, "total_bytes": 81559 * defaults.MIB, "used_bytes": 0,
         **(gpu if i == 0 else {})} for i in range(2)]}
    return {defaults.INVENTORY_ANNOTATION: json.dumps(inv)}


def node_data(cluster: Cluster, name: str) -> dict[str, Any]:
    return next((c for c in cluster.status(name).get("conditions", []) if c["type"] == "NodeData"), {})


def refused(node_name: str) -> float:
    return REGISTRY.get_sample_value("vllmfit_node_data_refused_total", {"node": node_name}) or 0.0


@pytest.mark.parametrize("bad", [
    {"metadata": {"annotations": {defaults.INVENTORY_ANNOTATION: "{not json"}}},
    {"metadata": {"annotations": inventory(unknown_field=1, total_bytes=-5)}},
    {"metadata": {"annotations": inventory(index=999)}},
    {"metadata": {"annotations": inventory(total_bytes=10**30)}},
    {"metadata": {"labels": {"nvidia.com/gpu.count": "abc"}, "annotations": {defaults.INVENTORY_ANNOTATION: None}}},
])
async def test_bad_node_data_keeps_the_node(cluster: Cluster, operator: Operator, bad: dict[str, Any]) -> None:
    await cluster.create(node("gpu-a", gpus=2, annotations=inventory()))
    await cluster.create(vd("a", QWEN7))
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    before = refused("gpu-a")
    await cluster.patch_node("gpu-a", bad)
    await cluster.until(lambda: node_data(cluster, "a").get("status") == "False", what="the NodeData condition")
    assert node_data(cluster, "a")["reason"] == "NodeDataRefused"
    assert "keeps its last good state" in node_data(cluster, "a")["message"]
    await cluster.event("a", "NodeDataRefused")
    assert refused("gpu-a") > before
    assert cluster.status("a")["phase"] == "Admitted"  # not Unschedulable: nothing is evicted
    assert cluster.get(DEPLOYMENTS, "a-0") is not None
    # fixed: the condition clears
    fix: dict[str, Any] = {"metadata": {"annotations": inventory()}}
    if "labels" in bad["metadata"]:
        fix["metadata"]["labels"] = {"nvidia.com/gpu.count": "2"}
    await cluster.patch_node("gpu-a", fix)
    await cluster.until(lambda: node_data(cluster, "a").get("status") == "True", what="NodeData cleared")
    assert cluster.status("a")["phase"] == "Admitted"
