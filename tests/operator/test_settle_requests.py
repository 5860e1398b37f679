"""Issue 32: what one new VLLMDeployment costs the API. Kopf adds its finalizer (a JSON Patch
guarded by the resourceVersion it read), then the create handler decides, books and writes the
status, the Deployment and the Service, then Kopf records the spec it handled. Nothing decides
the object before the finalizer is in: a status written then made the finalizer's guarded patch
fail (422), and Kopf sent it again after the status's echo, and decided the object twice."""

from __future__ import annotations

from typing import Any

import pytest
from opkit import DEPLOYMENTS, VD, Cluster, Operator, node, vd

from vllmfit.operator.handlers import vllmdeployments
from vllmfit.operator.handlers.common import HANDLED

pytestmark = pytest.mark.looptime  # waits in virtual seconds: no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"


def object_patches(cluster: Cluster, name: str) -> list[Any]:
    """The PATCH requests of the VLLMDeployment `name` itself (not its status), in order."""
    return [r for r in cluster.km.journal if str(r.method).upper().endswith("PATCH")
            and str(r.url.path).endswith(f"/vllmdeployments/{name}")]


def status_patches(cluster: Cluster, name: str) -> list[Any]:
    return [r for r in cluster.km.journal if str(r.method).upper().endswith("PATCH")
            and str(r.url.path).endswith(f"/vllmdeployments/{name}/status")]


async def test_a_new_deployment_is_decided_once_after_the_finalizer(
        cluster: Cluster, operator: Operator, monkeypatch: Any) -> None:
    decided: list[str] = []
    reconcile = vllmdeployments.reconcile

    async def counted(store: Any, body: Any, *, force: bool) -> None:
        decided.append(body["metadata"]["name"])
        await reconcile(store, body, force=force)

    monkeypatch.setattr(vllmdeployments, "reconcile", counted)
    await cluster.create(node("gpu-a", gpus=2))
    for name in ("a", "b", "c"):
        await cluster.create(vd(name, QWEN7, maxModelLen=8192, maxNumSeqs=4))
    for name in ("a", "b", "c"):
        await cluster.phase(name, "Admitted")
        await cluster.until(lambda n=name: cluster.get(DEPLOYMENTS, f"{n}-0"), what=f"{name}-0 written")
        await cluster.until(lambda n=name: HANDLED in (cluster.get(VD, n)["metadata"].get("annotations") or {}),
                            what=f"{name} handled")
    await cluster.store.writer.flush()
    assert sorted(decided) == ["a", "b", "c"]  # the create handler's, once each
    for name in ("a", "b", "c"):
        patches = object_patches(cluster, name)
        assert len(patches) == 2, [p.data for p in patches]  # the finalizer, then the handled spec
        assert "finalizers" in str(patches[0].data) and HANDLED in str(patches[1].data)
        first_status = cluster.km.journal.index(status_patches(cluster, name)[0])
        assert cluster.km.journal.index(patches[0]) < first_status  # the finalizer is in before it books
