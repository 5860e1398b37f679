"""Deletions the delete handler never sees, statuses lost on the way, and the resync that
repairs them (issue 14, items 5 and 13)."""

from __future__ import annotations

from typing import Any

import pytest
from bookkit import resync
from kubernetes_asyncio import client
from opkit import DEPLOYMENTS, VD, Cluster, Operator, node, vd

from vllmfit.core.spec import api

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
BIG = {"maxModelLen": 32768, "kvCache": {"concurrency": 8}}  # one per H100
BIGGER = {"maxModelLen": 32768, "kvCache": {"concurrency": 16}}  # only on an empty H100


async def drop(cluster: Cluster, name: str) -> None:
    """Delete without the finalizer: the delete handler never runs (a `kubectl patch` removing
    it, or a deletion racing the create, before Kopf added it)."""
    await cluster.custom.patch_namespaced_custom_object(
        api.GROUP, api.VERSION, "default", api.PLURAL, name, {"metadata": {"finalizers": None}},
        _content_type="application/merge-patch+json")
    await cluster.delete(name)


async def test_a_deletion_seen_only_as_an_event_frees_the_room(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("a", QWEN7, **BIG))
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    await cluster.create(vd("b", QWEN7, **BIGGER))
    await cluster.phase("b", "Unschedulable")
    await drop(cluster, "a")
    await cluster.phase("b", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0") is None, what="a-0 stopped")
    assert cluster.store.books.ledger.deployments() == ["default/b"]


async def test_a_resync_after_a_missed_deletion_frees_the_room_and_retries_the_waiting(
        km: Any, cluster: Cluster) -> None:
    op = Operator(km)
    await op.start()
    try:
        await cluster.create(node("gpu-a", gpus=1))
        await cluster.create(vd("a", QWEN7, **BIG))
        await cluster.phase("a", "Admitted")
        await cluster.create(vd("b", QWEN7, **BIGGER))
        await cluster.phase("b", "Unschedulable")
        await op.stop()
        await cluster.reconnect()
        await drop(cluster, "a")  # while no operator watches
        await op.start()
        store = cluster.store
        await store.writer.flush()
        await resync(store)
        st = await cluster.phase("b", "Admitted")
        assert st["node"] == "gpu-a"
        await cluster.until(lambda: cluster.get(DEPLOYMENTS, "b-0"))
        assert cluster.get(DEPLOYMENTS, "a-0") is None  # no booking covers it: the start-up sweep stopped it
    finally:
        await op.stop()


async def test_a_resync_repairs_a_status_that_differs_from_the_record(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("a", QWEN7))
    st = await cluster.phase("a", "Admitted")
    # a status write lost on the way: the API holds none
    await cluster.custom.patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, "default", api.PLURAL, "a", {"status": None},
        _content_type="application/merge-patch+json")
    assert cluster.status("a") == {}
    store = cluster.store
    await resync(store)
    await store.writer.flush()
    assert cluster.status("a") == st
    assert [b.node for b in store.books.ledger.bookings_of("default/a")] == ["gpu-a"]


async def test_the_resync_stops_a_deployment_no_booking_covers(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=1))
    await cluster.create(vd("a", QWEN7))
    await cluster.phase("a", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"))
    stray = dict(cluster.get(DEPLOYMENTS, "a-0"))
    stray["metadata"] = {**stray["metadata"], "name": "a-1", "uid": "stray"}
    # a replica left behind (a crash before its release was written)
    await client.AppsV1Api(cluster.api).create_namespaced_deployment("default", stray)
    await resync(cluster.store)
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-1") is None, what="a-1 stopped")
    assert cluster.get(DEPLOYMENTS, "a-0") is not None and cluster.get(VD, "a") is not None
