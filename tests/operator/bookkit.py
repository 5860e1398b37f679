"""Operator state built by the operator's own code paths, for tests that call the handlers and the
Store directly (no emulator): VLLMDeployment objects and bodies, bare GPU nodes, a deployment
admitted as a handler's transaction admits it, two nodes with three deployments, the Deployment
vllmfit writes for a replica, and a resync run once it may (a helpers module: test modules never
import each other)."""

from __future__ import annotations

import asyncio
from typing import Any

from vllmfit.core import placement
from vllmfit.core.spec import api
from vllmfit.operator.booking import report
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers import common, decide, startup
from vllmfit.operator.rendering import builders
from vllmfit.sources import catalog

H100 = "NVIDIA-H100-80GB-HBM3"
QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
GIB = 1 << 30


def obj(name: str = "x", **spec: Any) -> api.VLLMDeployment:
    return api.VLLMDeployment.model_validate({"metadata": {"name": name, "namespace": "ns",
                                                           "creationTimestamp": f"2030-01-01T00:00:0{len(name)}Z"},
                                              "spec": {"model": QWEN7, **spec}})


def body(name: str, status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    b = {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment",
         "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1,
                      "creationTimestamp": f"2030-01-01T00:00:{len(name):02d}Z"},
         "spec": {"model": QWEN7, **spec}}
    if status is not None:
        b["status"] = status
    return b


def node(name: str, gpus: int = 1) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"nvidia.com/gpu.product": H100, "nvidia.com/gpu.count": str(gpus)}}}


def admitted_status(store: Store, name: str, **spec: Any) -> dict[str, Any]:
    """What the operator would have written for `name` after admitting it on `store`'s ledger. One request
    of the context as its KV cache (with no kvCache it would take the room left: issue 24)."""
    spec = {"kvCache": {"concurrency": 1}, **spec}
    req = placement.request_from_object(obj(name, **spec), catalog.model(QWEN7))
    d = placement.decide(store.books.ledger, req)
    assert d.admitted
    store.books.ledger.book(d)
    rec = store.cache.upsert(body(name, **spec))
    fx = common.Effects()
    with store.books.step():  # one change, as a handler's transaction applies it
        decide.apply_decision(store, rec, req, d, fx)
    return report.status(rec, store.books.ledger)


def two_nodes() -> Store:
    store = Store()
    store.rebuild([node("gpu-a", 1), node("gpu-b", 1)], [])
    for name in ("a", "bb", "ccc"):  # about 32 GiB each: two to a GPU
        admitted_status(store, name, maxModelLen=32768, kvCache={"concurrency": 8})
    return store


def child(owner: dict[str, Any], where: str, uid: str | None = None) -> dict[str, Any]:
    name = owner["metadata"]["name"]
    return {"metadata": {"name": f"{name}-0", "namespace": owner["metadata"]["namespace"],
                         "labels": {builders.MANAGED_BY: "vllmfit", builders.LABEL_DEPLOYMENT: name,
                                    builders.LABEL_REPLICA: "0"},
                         "annotations": {builders.ANNOTATION_PLACEMENT: where},
                         "ownerReferences": [{"kind": "VLLMDeployment", "name": name, "controller": True,
                                              "uid": uid or owner["metadata"]["uid"]}]}}


async def resync(store: Any) -> None:
    for _ in range(200):  # it skips while a status write or a change is in flight
        if await startup.resync_once(store):
            await store.queue.join()  # the reconciles it queued
            return
        await asyncio.sleep(0.02)
    raise AssertionError("resync never ran")
