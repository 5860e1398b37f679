"""What one VLLMDeployment applied through the webhook costs the API server, through the real
operator on KMock: its status written once (the `Enforced` condition is in the status that books
it, not in a second write after its Deployment) and its object never patched: no handled-spec
annotation (the operator does not use Kopf's change detection: handlers.startup.DiffBase) and no
finalizer patch (the finalizer came with it from the mutating webhook). Before: two status
writes per deployment, a patch of Kopf's annotation per deployment and change, and the finalizer
patch was refused (422) and sent again about twice per deployment in a burst
(benchmarks/operator_scale.py counts them at 5,000)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jsonpatch
import pytest
from opkit import VD, Cluster, Operator, node, vd

from vllmfit.operator.admission.verdict import finalizer_ops

pytestmark = pytest.mark.looptime  # waits in virtual seconds

N = 6


def as_admitted(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it after vllmfit's mutating webhook."""
    return jsonpatch.apply_patch(obj, finalizer_ops(obj["metadata"]))


async def test_one_status_write_and_no_patch_of_the_object_per_deployment(cluster: Cluster, operator: Operator) -> None:
    for i in range(N):  # each alone on its node: no neighbour's admission changes its status
        await cluster.create(node(f"gpu-{i}", 1))
    for i in range(N):
        await cluster.create(as_admitted(vd(f"d{i}", "Qwen/Qwen2.5-0.5B-Instruct", maxModelLen=4096, maxNumSeqs=16,
                                            placement={"nodeName": f"gpu-{i}"})))
    for i in range(N):
        await cluster.phase(f"d{i}", "Admitted", timeout=30)
    await cluster.store.writer.flush()
    for i in range(N):  # the Deployments are written, and what they are bound with is in the status
        await cluster.until(lambda i=i: cluster.get("apps/v1/deployments", f"d{i}-0"), 30, f"d{i}-0 written")
        types = [c["type"] for c in cluster.status(f"d{i}")["conditions"]]
        assert "Enforced" in types, types
    await cluster.store.writer.flush()
    def named(path: str) -> str:  # .../vllmdeployments/NAME[/status]
        parts = path.split("/")
        return parts[parts.index("vllmdeployments") + 1]

    patches = Counter(("status" if r.subresource == "status" else "object", named(r.url.path))
                      for r in cluster.km.sent("patch", VD))
    for i in range(N):
        assert [p["node"] for p in cluster.status(f"d{i}")["placement"]] == [f"gpu-{i}"]
        assert patches[("status", f"d{i}")] == 1, patches
        assert patches[("object", f"d{i}")] == 0, patches  # no handled-spec annotation, no finalizer
