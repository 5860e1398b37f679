"""Scaling a VLLMDeployment through its scale subresource, as `kubectl scale` and a
HorizontalPodAutoscaler do, against the real operator on KMock's emulator.

KMock has no /scale endpoint for custom resources (shared/testing.md, section 2), so the scale call
is emulated the way the API server carries it out: it reads `.status.replicas` and
`.status.selector` through the CRD's statusReplicasPath and labelSelectorPath, and writes the new
count to the CRD's specReplicasPath (`.spec.replicas`) as a spec change (generation + 1). The
HPA object itself is checked against the Kubernetes OpenAPI schema with kubernetes-validate.
"""

from __future__ import annotations

import math
from typing import Any

import kubernetes_validate
import pytest
from opkit import DEPLOYMENTS, Cluster, Operator, node, vd

from vllmfit.cli import crdgen
from vllmfit.core.spec import api

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"  # two fit on one H100 next to each other, not three
SCALE = crdgen.render_crd()["spec"]["versions"][0]["subresources"]["scale"]


def hpa(name: str, min_replicas: int = 1, max_replicas: int = 4) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "scaleTargetRef": {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "name": name},
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": "vllm:num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "10"}}}],
        },
    }


def _path(obj: dict[str, Any], path: str) -> Any:
    for part in path.strip(".").split("."):
        obj = (obj or {}).get(part)
    return obj


def read_scale(cluster: Cluster, name: str) -> dict[str, Any]:
    """GET .../vllmdeployments/NAME/scale, as the API server answers it from the CRD's paths."""
    obj = cluster.get(f"{api.GROUP}/{api.VERSION}/{api.PLURAL}", name)
    return {"spec": {"replicas": _path(obj, SCALE["specReplicasPath"])},
            "status": {"replicas": _path(obj, SCALE["statusReplicasPath"]) or 0,
                       "selector": _path(obj, SCALE["labelSelectorPath"])}}


async def hpa_sync(cluster: Cluster, h: dict[str, Any], waiting_per_pod: float) -> int:
    """One HPA controller sync: desired = ceil(current x metric / target), clamped to
    [minReplicas, maxReplicas] (pkg/controller/podautoscaler), written through /scale."""
    spec = h["spec"]
    target = float(spec["metrics"][0]["pods"]["target"]["averageValue"])
    name = spec["scaleTargetRef"]["name"]
    current = read_scale(cluster, name)["status"]["replicas"]
    desired = max(spec["minReplicas"], min(spec["maxReplicas"], math.ceil(current * waiting_per_pod / target)))
    await cluster.patch_spec(name, {SCALE["specReplicasPath"].split(".")[-1]: desired})
    return desired


def test_the_hpa_targeting_a_vllmdeployment_is_a_valid_autoscaling_v2_object() -> None:
    h = hpa("s")
    for version in ("1.29", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(h, version, strict=True)
    ref = h["spec"]["scaleTargetRef"]
    crd = crdgen.render_crd()
    assert (ref["apiVersion"], ref["kind"]) == (f"{crd['spec']['group']}/{api.VERSION}", crd["spec"]["names"]["kind"])
    assert SCALE["specReplicasPath"] == ".spec.replicas"


async def test_hpa_grows_while_it_fits_never_past_and_shrinks_always(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("s", QWEN7, replicas=1, kvCache={"concurrency": 8}))  # ~35 GiB a replica
    st = await cluster.phase("s", "Admitted")
    assert (st["replicas"], st["readyReplicas"], st["ready"]) == (1, 0, "0/1")
    assert st["selector"] == "app.kubernetes.io/managed-by=vllmfit,vllmfit.dev/deployment=s"
    first = st["placement"][0]
    h = hpa("s")

    # 15 waiting requests per pod against a target of 10: ceil(1 x 15 / 10) = 2 replicas
    assert await hpa_sync(cluster, h, 15) == 2
    await cluster.until(lambda: cluster.status("s").get("replicas") == 2, what="2 replicas")
    await cluster.store.writer.flush()
    st = cluster.status("s")
    assert st["placement"][0] == first  # the replica that was there stays
    assert st["ready"] == "0/2" and st["phase"] == "Admitted"
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "s-1"), what="s-1 written")
    await cluster.event("s", "Scaled")

    # ceil(2 x 15 / 10) = 3: a third Qwen 7B does not fit on the GPU; the two keep serving
    assert await hpa_sync(cluster, h, 15) == 3
    await cluster.until(lambda: next((c for c in cluster.status("s").get("conditions", [])
                                      if c["type"] == "Admitted" and c["status"] == "False"), None),
                        what="the growth refused")
    await cluster.store.writer.flush()
    st = cluster.status("s")
    assert st["replicas"] == 2 and st["ready"] == "0/3" and len(st["placement"]) == 2
    admitted = next(c for c in st["conditions"] if c["type"] == "Admitted")
    assert admitted["reason"] == "UpdateUnschedulable"
    assert read_scale(cluster, "s") == {"spec": {"replicas": 3},
                                        "status": {"replicas": 2, "selector": st["selector"]}}

    # 2 waiting per pod: ceil(2 x 2 / 10) = 1; a shrink always succeeds and frees s-1's room
    assert await hpa_sync(cluster, h, 2) == 1
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "s-1") is None, what="s-1 deleted")
    await cluster.store.writer.flush()
    st = cluster.status("s")
    assert (st["replicas"], st["ready"], st["placement"][0]) == (1, "0/1", first)
    assert next(c for c in st["conditions"] if c["type"] == "Admitted")["status"] == "True"
    assert len(cluster.store.books.ledger.bookings_of("default/s")) == 1


async def test_a_change_nothing_needs_memory_for_keeps_every_replica_where_it_is(cluster: Cluster,
                                                                                operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(vd("k", QWEN7, replicas=2))
    st = await cluster.phase("k", "Admitted")
    before = st["placement"]
    await cluster.patch_spec("k", {"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
                                   "podTemplate": {"spec": {"tolerations": [{"key": "x", "operator": "Exists"}]}}})
    await cluster.until(lambda: cluster.status("k").get("observedGeneration") == 2, what="generation 2")
    await cluster.store.writer.flush()
    assert cluster.status("k")["placement"] == before
    assert not any(e["reason"] == "Moved" for e in cluster.events("k"))
    dep = cluster.get(DEPLOYMENTS, "k-0")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "k-0")["spec"]["template"]["spec"].get("tolerations", [])[-1:]
                        == [{"key": "x", "operator": "Exists"}], what="the toleration written")
    assert dep is not None
