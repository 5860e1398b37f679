"""The children's cache key is derived from what the Deployments are rendered from (issue 29).

Before, `children_state` listed the inputs of `builders.deployment` by hand, and an input it left
out changed nothing: the Deployment was not rewritten. `weights_bytes` (the replica's checkpoint,
which sets its startup probe's failureThreshold) was one: a booking whose weights changed while
its predicted total did not kept the old probe. Now the key is the writer's own arguments
(children.replica_inputs), so every input of the rendering is in it."""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import pytest
from kubernetes_asyncio import client
from opkit import DEPLOYMENTS, Cluster, km_url, node, vd

from vllmfit.core import defaults
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers import children
from vllmfit.operator.handlers.vllmdeployments import reconcile
from vllmfit.operator.rendering import builders

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

GIB = 2**30


def probe_threshold(cluster: Cluster, name: str) -> int:
    dep = cluster.get(DEPLOYMENTS, name)
    assert dep is not None, f"no Deployment {name}"
    [vllm] = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    return int(vllm["startupProbe"]["failureThreshold"])


async def test_an_input_the_hand_listed_key_left_out_rewrites_the_child(km: Any) -> None:
    cluster = Cluster(km)
    a = vd("a", "Qwen/Qwen2.5-7B-Instruct", maxModelLen=8192)
    await cluster.create(a)
    store = Store()
    store.api = client.ApiClient(client.Configuration(host=km_url(km)))
    store.rebuild([node("gpu-a", gpus=1)], [])
    store.leading = True
    try:
        await reconcile(store, a, force=False)  # admitted, its Deployment written
        rec = store.cache.records["default/a"]
        [b] = store.books.ledger.bookings_of("default/a")
        before = probe_threshold(cluster, "a-0")
        synced = rec.synced
        # the same predicted bytes, 40 GiB more of them weights: a checkpoint that takes longer to load
        more = dataclasses.replace(b.footprint, weights=b.footprint.weights + 40 * GIB,
                                   kv_cache=b.footprint.kv_cache - 40 * GIB)
        assert more.predicted == b.footprint.predicted
        async with store.books.changing():
            store.books.ledger.restore("default/a", [dataclasses.replace(b, footprint=more)])
        assert builders.booked_text(store.books.committed.bookings_of("default/a")) == \
               builders.booked_text([b])  # what the old key compared did not move
        assert children.children_state(store, rec) != synced
        await children.sync_children(store, "default/a")
        # the probe covers the base start-up plus loading the weights at the assumed rate
        want = math.ceil((defaults.STARTUP_BASE_SECONDS + math.ceil(more.weights / defaults.STARTUP_LOAD_BYTES_PER_SECOND))
                         / defaults.STARTUP_PROBE_PERIOD_SECONDS)
        assert probe_threshold(cluster, "a-0") == want != before
        assert rec.synced == children.children_state(store, rec)  # and the next look writes nothing
    finally:
        await store.api.close()
        await cluster.api.close()


def test_every_argument_of_the_rendering_is_in_the_key() -> None:
    """replica_inputs supplies every parameter of builders.deployment except the three the writer
    settles against the existing Deployment (exclusive, gated, and enforce: a running replica keeps
    its enforcement): a new parameter that the writer passed without going through replica_inputs
    would miss the key, and fails here."""
    params = set(inspect.signature(builders.deployment).parameters)
    source = inspect.getsource(children.replica_inputs)
    supplied = {p for p in params if f'"{p}":' in source}
    assert params - supplied == {"exclusive", "gated", "enforce"}
    writer = inspect.getsource(children.sync_children)
    assert "builders.deployment(**{**inputs" in writer  # the writer renders from the key's inputs
