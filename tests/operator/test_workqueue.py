"""The reconcile queue (booking.workqueue): a watch event only queues its object's key; each key is
reconciled once at a time, by at most `workers` at once, from the latest body; news during a run
runs it once more after; a failed run comes back after its delay; a deleted object's waiting run
is dropped and its running one waited for, so the deletion frees whatever it booked.

The last two tests replay a deletion that comes while the object's reconcile is deciding (asyncio
events, no clock): without `WorkQueue.forget` in the deletion (handlers.vllmdeployments.forget),
the deletion finds no record yet and returns, then the reconcile commits: a deleted object
booked on its GPU, with a Deployment (seen failing so); the same when the resync, not an event,
asked for the reconcile and ran it itself (seen failing so)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import kopf
import pytest
from kubernetes_asyncio import client
from opkit import DEPLOYMENTS, VD, Cluster, km_url, node, vd

from vllmfit.operator.admission import bounded
from vllmfit.operator.booking.state import Store
from vllmfit.operator.booking.workqueue import RETRY_MIN_S, WorkQueue
from vllmfit.operator.handlers import vllmdeployments

pytestmark = pytest.mark.looptime  # delays in virtual seconds: no wall time


def body(name: str, generation: int = 1, uid: str = "u") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default", "generation": generation, "uid": uid}, "spec": {}}


class Runs:
    """What the queue ran: (name, generation, force), and how many at once at most."""

    def __init__(self, hold: asyncio.Event | None = None, fail: int = 0, delay: float | None = None) -> None:
        self.seen: list[tuple[str, int, bool]] = []
        self.running = self.most = 0
        self.hold, self.fail, self.delay = hold, fail, delay

    async def __call__(self, latest: Mapping[str, Any], force: bool) -> None:
        self.seen.append((latest["metadata"]["name"], latest["metadata"]["generation"], force))
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.fail:
                self.fail -= 1
                raise kopf.TemporaryError("not yet", delay=self.delay) if self.delay else RuntimeError("failed")
        finally:
            self.running -= 1


async def test_a_burst_runs_each_key_once_from_its_latest_body_and_at_most_workers_at_once() -> None:
    q, release = WorkQueue(workers=3), asyncio.Event()
    runs = Runs(hold=release)
    q.start(runs)
    for g in (1, 2, 3):  # three events of each of ten objects before any run ends
        for i in range(10):
            q.add(body(f"d{i}", g), force=(g == 2 and i == 0))
    await asyncio.sleep(0.1)
    assert runs.running == 3 and q.depth() == 7  # three run, the others wait as keys
    release.set()
    await q.join()
    # the three that ran first ran from the body they had; each ran once more only if news came
    # after it started (none here: every add came before any run could start)
    assert sorted(runs.seen) == sorted([(f"d{i}", 3, i == 0) for i in range(10)])
    assert runs.most == 3
    await q.stop()


async def test_news_during_a_run_runs_it_once_more_after() -> None:
    q, release = WorkQueue(workers=4), asyncio.Event()
    runs = Runs(hold=release)
    q.start(runs)
    q.add(body("a", 1))
    await asyncio.sleep(0.01)
    for g in (2, 3, 4):  # while a runs: not alongside it, once after it, from the latest
        q.add(body("a", g))
    await asyncio.sleep(0.01)
    assert runs.seen == [("a", 1, False)] and runs.most == 1
    release.set()
    await q.join()
    assert runs.seen == [("a", 1, False), ("a", 4, False)]
    await q.stop()


async def test_a_failed_run_comes_back_after_its_delay_or_a_doubling_backoff() -> None:
    loop = asyncio.get_running_loop()
    q = WorkQueue(workers=1)
    named = Runs(fail=1, delay=30)
    q.start(named)
    t0 = loop.time()
    q.add(body("a"))
    await asyncio.sleep(29)
    assert len(named.seen) == 1  # kopf.TemporaryError(delay=30): not before 30 s
    await asyncio.sleep(2)
    assert len(named.seen) == 2 and loop.time() - t0 < 32
    await q.stop()

    q = WorkQueue(workers=1)
    backoff = Runs(fail=3)
    q.start(backoff)
    started = loop.time()
    q.add(body("b"))
    await asyncio.sleep(RETRY_MIN_S * (1 + 2 + 4) + 0.5)
    assert len(backoff.seen) == 4  # 1 s, 2 s, 4 s after the failures
    assert loop.time() - started < RETRY_MIN_S * 8
    await q.stop()


async def test_news_cancels_a_waiting_retry() -> None:
    q = WorkQueue(workers=1)
    runs = Runs(fail=1, delay=600)
    q.start(runs)
    q.add(body("a", 1))
    await asyncio.sleep(1)
    q.add(body("a", 2))  # a new spec: now, not in ten minutes
    await q.join()
    assert runs.seen == [("a", 1, False), ("a", 2, False)]
    await q.stop()


async def test_forget_drops_a_waiting_run_and_waits_for_a_running_one() -> None:
    q, release = WorkQueue(workers=1), asyncio.Event()
    runs = Runs(hold=release)
    q.start(runs)
    q.add(body("a"))
    q.add(body("b"))  # waits behind a
    await asyncio.sleep(0.01)
    await q.forget("default/b", "u")
    forgetting = asyncio.create_task(q.forget("default/a", "u"))
    await asyncio.sleep(1)
    assert not forgetting.done()  # a's run is under way: the deletion waits for it
    release.set()
    await forgetting
    await q.join()
    assert runs.seen == [("a", 1, False)]  # b never ran
    q.add(body("c", uid="new"))
    q_c = asyncio.create_task(q.forget("default/c", "old"))  # the deletion of an older object of that name
    await q_c
    await q.join()
    assert runs.seen[-1] == ("c", 1, False)  # the new object's run stays
    await q.stop()


def store_on(km: Any, objects: list[dict[str, Any]]) -> Store:
    """The operator's state on the emulator: one node with one GPU, `objects` read back at start-up, leading."""
    store = Store()
    store.api = client.ApiClient(client.Configuration(host=km_url(km)))
    store.rebuild([node("gpu-a", gpus=1)], objects)
    store.leading = True
    return store


def held_decisions(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Every decision waits for `go` once `deciding` says one has begun."""
    deciding, go = asyncio.Event(), asyncio.Event()
    real = bounded.decide

    async def held(*args: Any, **kwargs: Any) -> Any:
        deciding.set()
        await go.wait()
        return await real(*args, **kwargs)

    monkeypatch.setattr(bounded, "decide", held)
    return deciding, go


async def deleted_meanwhile(store: Store, a: dict[str, Any], deciding: asyncio.Event, go: asyncio.Event) -> None:
    """`a` is deleted while its reconcile decides; the decision ends after the deletion began."""
    await deciding.wait()
    deletion = asyncio.create_task(vllmdeployments.forget(store, a))
    await asyncio.sleep(1)
    go.set()
    await deletion


async def never_booked(store: Store, cluster: Cluster) -> None:
    await store.queue.join()
    await store.placing.stop()
    assert store.books.ledger.deployments() == []
    assert "default/a" not in store.cache.records
    assert not [d for d in cluster.objects(DEPLOYMENTS) if d["metadata"]["name"].startswith("a-")]


async def test_an_object_deleted_while_its_reconcile_decides_is_never_booked(
        km: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = Cluster(km)
    await cluster.create(vd("a", "Qwen/Qwen2.5-0.5B-Instruct", maxModelLen=4096, maxNumSeqs=16))
    a = cluster.get(VD, "a")  # as the API stores it (its uid)
    store = store_on(km, [])
    deciding, go = held_decisions(monkeypatch)
    try:
        vllmdeployments.enqueue(store, a)  # its first event; its reconcile decides while it is deleted
        await deleted_meanwhile(store, a, deciding, go)
        await never_booked(store, cluster)
    finally:
        await store.stop()
        await store.api.close()
        await cluster.api.close()


async def test_an_object_the_resync_decides_and_that_is_deleted_meanwhile_is_never_booked(
        km: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resync decides an object that has no status through the work queue, so its deletion
    waits for that reconcile too. When the resync reconciled it itself (seen failing so), the
    deletion did not wait: it released nothing, then the reconcile booked the deleted object."""
    from vllmfit.operator.handlers import startup

    cluster = Cluster(km)
    await cluster.create(vd("a", "Qwen/Qwen2.5-0.5B-Instruct", maxModelLen=4096, maxNumSeqs=16))
    await cluster.create(node("gpu-a", gpus=1))
    a = cluster.get(VD, "a")
    store = store_on(km, [a])  # a: read back with no status, undecided
    deciding, go = held_decisions(monkeypatch)
    try:
        resync = asyncio.create_task(startup.resync_once(store))  # its reconcile of a decides while a is deleted
        await deleted_meanwhile(store, a, deciding, go)
        assert await resync
        await never_booked(store, cluster)
    finally:
        await store.stop()
        await store.api.close()
        await cluster.api.close()
