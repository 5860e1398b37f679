"""Issue 32: the operator's work per event does not grow with every object of the cluster.

- After an event, the records looked at for pinning that changed for a reason not their own
  (writes.rebook_reported) are those on the nodes where something changed, not every record.
- The reservation sync (a pass over the whole ledger) is coalesced: callers that come while a
  pass waits to start join it, so a burst of events runs a pass or two, not one each.
- A reconcile that finds nothing to decide (the create handler after the event handler decided
  the object) runs no reservation pass and looks at no record's children: it only has its
  status looked at again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from bookkit import node, two_nodes
from kubernetes_asyncio import client
from opkit import Cluster, km_url, vd

from vllmfit.operator.binding import reservations
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers import writes
from vllmfit.operator.handlers.vllmdeployments import reconcile


def test_after_an_event_only_the_records_on_the_nodes_that_changed_are_looked_at() -> None:
    store = two_nodes()
    on = {k: {b.node for b in store.books.ledger.bookings_of(k)} for k in store.cache.records}
    assert set().union(*on.values()) == {"gpu-a", "gpu-b"}  # both nodes hold something
    assert sorted(writes.pinned_anew(store)) == sorted(store.cache.records)  # after the rebuild: every record
    assert writes.pinned_anew(store) == []  # nothing changed since
    store.cache.pins_dirty.add("gpu-b")  # e.g. a whole-node holder came or went there
    assert writes.pinned_anew(store) == sorted(k for k, nodes in on.items() if "gpu-b" in nodes)
    writes.touched(store, {k for k, nodes in on.items() if "gpu-a" in nodes})  # decided or marked
    assert writes.pinned_anew(store) == sorted(k for k, nodes in on.items() if "gpu-a" in nodes)


async def test_reservation_passes_asked_for_meanwhile_are_joined(monkeypatch: Any) -> None:
    store = Store()
    store.api = object()  # a pass runs only with an API client (the fake pass never uses it)
    passes: list[int] = []
    release = asyncio.Event()

    async def one_pass(s: Store) -> None:
        passes.append(len(passes))
        await release.wait()

    monkeypatch.setattr(reservations, "_sync_once", one_pass)
    first = asyncio.create_task(reservations.sync(store))
    await asyncio.sleep(0)  # the first pass has started (it waits inside)
    burst = [asyncio.create_task(reservations.sync(store)) for _ in range(20)]
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, *burst)
    assert len(passes) == 2  # the running one, and one more that every later caller joined
    await reservations.sync(store)  # a caller after them gets a pass of its own (it may have changed something)
    assert len(passes) == 3


async def test_a_failed_pass_is_raised_to_every_caller_that_joined_it(monkeypatch: Any) -> None:
    store = Store()
    store.api = object()
    gate = asyncio.Event()

    async def failing(s: Store) -> None:
        await gate.wait()
        raise OSError("the API is gone")

    monkeypatch.setattr(reservations, "_sync_once", failing)
    calls = [asyncio.create_task(reservations.sync(store)) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results)


@pytest.mark.looptime  # the pass's wait in virtual seconds
async def test_a_burst_gets_one_pass_paced_by_the_last_passs_cost(monkeypatch: Any) -> None:
    """reservations.PASS_SHARE: after a pass, the next one waits (1 / PASS_SHARE - 1) times the
    last one's computing time; a burst of callers meanwhile joins it (one pass per caller, back
    to back, was most of the operator's CPU at 5,000 deployments). Real passes, over an empty
    ledger (nothing to create: no request is sent), each computing for 1 s by the pass's clock."""
    store = two_nodes()
    store.api = object()
    loop = asyncio.get_running_loop()
    starts: list[float] = []
    ends: list[tuple[float, float]] = []

    def wanted(s: Store) -> set[tuple[str, int]]:
        starts.append(loop.time())
        return set()  # nothing wanted, nothing there: a pass sends no request

    monkeypatch.setattr(reservations, "wanted", wanted)
    clock = iter(range(1000))
    monkeypatch.setattr(reservations, "perf_counter", lambda: float(next(clock)))  # 1 s a pass
    await reservations.sync(store)  # the first pass starts at once
    ends.append(reservations._last_pass[store])
    await asyncio.gather(*(reservations.sync(store) for _ in range(20)))
    assert len(starts) == 2, starts  # the burst joined one pass
    ended, took = ends[0]
    assert took == 1.0 and starts[1] >= ended + took * (1 / reservations.PASS_SHARE - 1)


@pytest.mark.looptime
async def test_a_reconcile_with_nothing_to_decide_runs_no_pass(km: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(km)
    objs = [vd(name, "Qwen/Qwen2.5-0.5B-Instruct", maxModelLen=4096, maxNumSeqs=16) for name in ("a", "b")]
    for obj in objs:
        await cluster.create(obj)
    store = Store()
    store.api = client.ApiClient(client.Configuration(host=km_url(km)))
    store.rebuild([node("gpu-a", 1)], [])
    store.leading = True
    store.cache.runtime_classes = {"nvidia"}  # the GPU Operator's, as the watch would have listed it
    passes: list[int] = []
    looked: list[str] = []
    real_sync, real_state = reservations.sync, writes.children_state

    async def counted_sync(s: Store) -> None:
        passes.append(1)
        await real_sync(s)

    def counted_state(s: Store, rec: Any, *args: Any) -> Any:
        looked.append(rec.key)
        return real_state(s, rec, *args)

    monkeypatch.setattr(reservations, "sync", counted_sync)
    monkeypatch.setattr(writes, "children_state", counted_state)
    try:
        for obj in objs:  # the event handler decides each: both admitted on the one GPU
            await reconcile(store, obj, force=False)
        assert sorted(store.books.ledger.deployments()) == ["default/a", "default/b"]
        assert cluster.get("apps/v1/deployments", "a-0") and cluster.get("apps/v1/deployments", "b-0")
        assert passes  # a decision makes Kubernetes hold what it booked
        passes.clear()
        looked.clear()
        requests = len(km.journal)
        await reconcile(store, objs[0], force=False)  # the create handler: decided already
        assert passes == [] and looked == []  # no reservation pass, no neighbour's children
        assert len(km.journal) == requests  # and no write
        assert "default/a" in store.writer._dirty  # its status is looked at again
    finally:
        await store.api.close()
        await cluster.api.close()
