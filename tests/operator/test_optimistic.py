"""Reconciles decide on the committed snapshot without the writer's lock and commit optimistically
(issue 29): a commit whose snapshot is no longer the ledger is Stale and decides again.

The race is replayed on a fixed schedule (asyncio events, no sleeps, no clock): two reconciles
decide on the same snapshot, each wanting the last room on one GPU; A commits first; only then
B commits, finds the ledger moved (Stale), decides again on the new snapshot and is refused. The
second test runs the same schedule with the version check removed: B then commits what it decided
on the old snapshot (only the ledger's last guard, Ledger.book's OverBudget, keeps the GPU within
budget, and the reconcile fails), so the first test can fail. On the code before (decisions taken
holding the lock) this schedule cannot happen: B's decision waited for A's commit.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes_asyncio import client
from opkit import Cluster, km_url, node, vd

from vllmfit.core import defaults
from vllmfit.core.placement.ledger import OverBudget
from vllmfit.operator.admission import bounded
from vllmfit.operator.booking.books import Books, Stale
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.vllmdeployments import reconcile
from vllmfit.operator.rendering import builders

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
BIG = {"maxModelLen": 32768, "kvCache": {"concurrency": 16}}  # more than half of an H100's budget


class Schedule:
    """bounded.decide, held at fixed points: the first decision of each deployment waits, after
    deciding, until the test lets it commit; `both` is set once both have decided."""

    def __init__(self, keys: list[str]) -> None:
        self.real = bounded.decide
        self.turn = {k: asyncio.Event() for k in keys}
        self.both = asyncio.Event()
        self.snapshots: dict[str, list[Any]] = {k: [] for k in keys}  # the ledgers each decided on
        self.decisions: dict[str, list[Any]] = {k: [] for k in keys}

    async def decide(self, workers: Any, ledger: Any, req: Any, **kwargs: Any) -> Any:
        self.snapshots[req.key].append(ledger)
        d = await self.real(workers, ledger, req, **kwargs)
        self.decisions[req.key].append(d)
        if len(self.decisions[req.key]) == 1:
            if all(self.decisions.values()):
                self.both.set()
            await self.turn[req.key].wait()
        return d


async def race(km: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Store, Schedule, Cluster]:
    cluster = Cluster(km)
    a, b = vd("a", QWEN7, **BIG), vd("b", QWEN7, **BIG)
    for obj in (a, b):
        await cluster.create(obj)  # their statuses are written through the API
    store = Store()
    store.api = client.ApiClient(client.Configuration(host=km_url(km)))
    store.rebuild([node("gpu-a", gpus=1)], [])  # one H100: room for one of them
    store.leading = True  # this test is the only handler: no lead to take
    schedule = Schedule(["default/a", "default/b"])
    monkeypatch.setattr(bounded, "decide", schedule.decide)
    ta = asyncio.create_task(reconcile(store, a, force=False))
    tb = asyncio.create_task(reconcile(store, b, force=False))
    await schedule.both.wait()  # both decided, neither committed
    assert schedule.snapshots["default/a"][0] is schedule.snapshots["default/b"][0]  # the same snapshot
    assert all(d[0].admitted for d in schedule.decisions.values())  # each saw the room free
    assert not store.books.lock.locked()  # and decided without the writer's lock
    schedule.turn["default/a"].set()
    await ta  # A commits
    schedule.turn["default/b"].set()
    await tb  # B commits on a ledger that moved
    return store, schedule, cluster


async def test_two_reconciles_decided_on_one_snapshot_never_both_take_the_last_room(
        km: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store, schedule, cluster = await race(km, monkeypatch)
    try:
        assert store.books.stale == 1  # B's commit found the ledger moved
        assert len(schedule.decisions["default/b"]) == 2  # and B decided again, on the new snapshot
        assert schedule.snapshots["default/b"][1] is not schedule.snapshots["default/b"][0]
        assert schedule.decisions["default/b"][1].phase == "Unschedulable"
        assert store.books.ledger.deployments() == ["default/a"]
        assert store.books.ledger.over_budget() == []
        assert store.cache.records["default/b"].outcome == "Unschedulable"
        assert cluster.status("b").get("phase") == "Unschedulable" and not cluster.status("b").get("memory")
        assert cluster.get("apps/v1/deployments", "a-0") is not None
        assert cluster.get("apps/v1/deployments", "b-0") is None
    finally:
        await store.api.close()
        await cluster.api.close()


async def test_without_the_version_check_b_commits_a_decision_taken_on_the_old_snapshot(
        km: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is what the first test rests on: with Books.check made a no-op, B commits the
    decision it took on the old snapshot. Only the ledger's last guard (Ledger.book refuses a
    booking past a GPU's headroom) keeps the GPU within its budget, and B's reconcile fails with
    it instead of deciding again."""
    monkeypatch.setattr(Books, "check", lambda self, based_on: None)
    with pytest.raises(OverBudget, match="default/b no longer fits on gpu-a GPU 0"):
        await race(km, monkeypatch)


async def test_past_the_bound_a_reconcile_decides_under_the_lock_and_ends(
        km: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger that moves between every snapshot and its commit (here: every check is Stale)
    cannot starve a reconcile: after defaults.OPTIMISTIC_DECISIONS tries it decides holding the
    lock, where nothing can make it stale."""
    def always_stale(self: Books, based_on: int) -> None:
        self.stale += 1
        raise Stale("moved")

    monkeypatch.setattr(Books, "check", always_stale)
    cluster = Cluster(km)
    a = vd("a", QWEN7, **BIG)
    await cluster.create(a)
    store = Store()
    store.api = client.ApiClient(client.Configuration(host=km_url(km)))
    store.rebuild([node("gpu-a", gpus=1)], [])
    store.leading = True
    calls: list[bool] = []
    real = bounded.decide

    async def counted(workers: Any, ledger: Any, req: Any, **kwargs: Any) -> Any:
        calls.append(store.books.lock.locked())
        return await real(workers, ledger, req, **kwargs)

    monkeypatch.setattr(bounded, "decide", counted)
    try:
        await reconcile(store, a, force=False)
        assert store.books.stale == defaults.OPTIMISTIC_DECISIONS
        assert calls == [False] * defaults.OPTIMISTIC_DECISIONS + [True]  # the last one under the lock
        assert store.books.ledger.deployments() == ["default/a"]
        assert builders.gpus_of(store.books.ledger, "default/a") == {("gpu-a", 0)}
    finally:
        await store.api.close()
        await cluster.api.close()

