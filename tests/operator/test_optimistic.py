"""Reconciles decide on the committed snapshot without the writer's lock and commit optimistically
(issue 29): a commit whose snapshot is no longer the ledger is Stale and decides again.

The race is replayed on a fixed schedule (asyncio events, no sleeps, no clock): A decides on a
snapshot, wanting the last room on one GPU, and is held before its commit; B, a second reconcile
that comes meanwhile, decides holding the writer's lock (another reconcile is deciding: issue 32)
and takes that room; only then A commits, finds the ledger moved (Stale), decides again on the
new snapshot and is refused. The second test runs the same schedule with the version check
removed: A then commits what it decided on the old snapshot (only the ledger's last guard,
Ledger.book's OverBudget, keeps the GPU within budget, and the reconcile fails), so the first test
can fail. On the code before issue 29 (decisions taken holding the lock) this schedule cannot
happen: B's decision waited for A's commit.

A burst of creates (issue 32) decides each deployment once: before, every optimistic decision but
the first was Stale, and each deployment was decided up to OPTIMISTIC_DECISIONS + 1 times.
"""

from __future__ import annotations

import asyncio
import collections
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
    """bounded.decide, held at fixed points: the first decision of each deployment named in
    `held` waits, after deciding, until the test lets it commit (`turn`); `decided` is set then.
    Every decision is recorded with the ledger it was taken on and whether the writer's lock
    was held."""

    def __init__(self, held: list[str], lock: Any) -> None:
        self.real = bounded.decide
        self.lock = lock
        self.turn = {k: asyncio.Event() for k in held}
        self.decided = {k: asyncio.Event() for k in held}
        self.snapshots: dict[str, list[Any]] = collections.defaultdict(list)  # the ledgers each decided on
        self.decisions: dict[str, list[Any]] = collections.defaultdict(list)
        self.locked: dict[str, list[bool]] = collections.defaultdict(list)

    async def decide(self, workers: Any, ledger: Any, req: Any, **kwargs: Any) -> Any:
        self.snapshots[req.key].append(ledger)
        self.locked[req.key].append(self.lock.locked())
        d = await self.real(workers, ledger, req, **kwargs)
        self.decisions[req.key].append(d)
        if req.key in self.turn and len(self.decisions[req.key]) == 1:
            self.decided[req.key].set()
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
    schedule = Schedule(["default/a"], store.books.lock)
    monkeypatch.setattr(bounded, "decide", schedule.decide)
    ta = asyncio.create_task(reconcile(store, a, force=False))
    await schedule.decided["default/a"].wait()  # A decided on a snapshot, not committed
    assert schedule.decisions["default/a"][0].admitted  # it saw the room free
    assert schedule.locked["default/a"] == [False]  # and decided without the writer's lock
    await reconcile(store, b, force=False)  # B, while A is in flight: decides holding the lock, commits
    assert schedule.locked["default/b"] == [True]
    assert store.books.ledger.deployments() == ["default/b"]
    schedule.turn["default/a"].set()
    await ta  # A commits on a ledger that moved
    return store, schedule, cluster


async def test_two_reconciles_decided_on_one_snapshot_never_both_take_the_last_room(
        km: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store, schedule, cluster = await race(km, monkeypatch)
    try:
        assert store.books.stale == 1  # A's commit found the ledger moved
        assert len(schedule.decisions["default/a"]) == 2  # and A decided again, on the new snapshot
        assert schedule.snapshots["default/a"][1] is not schedule.snapshots["default/a"][0]
        assert schedule.decisions["default/a"][1].phase == "Unschedulable"
        assert store.books.ledger.deployments() == ["default/b"]
        assert store.books.ledger.over_budget() == []
        assert store.cache.records["default/a"].outcome == "Unschedulable"
        assert cluster.status("a").get("phase") == "Unschedulable" and not cluster.status("a").get("memory")
        assert cluster.get("apps/v1/deployments", "b-0") is not None
        assert cluster.get("apps/v1/deployments", "a-0") is None
    finally:
        await store.api.close()
        await cluster.api.close()


async def test_without_the_version_check_b_commits_a_decision_taken_on_the_old_snapshot(
        km: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is what the first test rests on: with Books.check made a no-op, A commits the
    decision it took on the old snapshot. Only the ledger's last guard (Ledger.book refuses a
    booking past a GPU's headroom) keeps the GPU within its budget, and A's reconcile fails with
    it instead of deciding again."""
    monkeypatch.setattr(Books, "check", lambda self, based_on: None)
    with pytest.raises(OverBudget, match="default/a no longer fits on gpu-a GPU 0"):
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



async def test_a_burst_of_creates_decides_each_deployment_once(km: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight reconciles at once (a burst of creates: issue 32), each fitting: the first decides on
    a snapshot; the others, another reconcile deciding, decide holding the lock, in the lock's
    order. Each deployment is decided once (the first at most twice: its snapshot may have moved
    under it) and at most one commit is Stale. Before, every optimistic decision but one went
    Stale: 8 reconciles made 26 decisions on this schedule, 18 commits Stale."""
    cluster = Cluster(km)
    small = [vd(f"s{i}", "Qwen/Qwen2.5-0.5B-Instruct", maxModelLen=4096, maxNumSeqs=16) for i in range(8)]
    for obj in small:
        await cluster.create(obj)
    store = Store()
    store.api = client.ApiClient(client.Configuration(host=km_url(km)))
    store.rebuild([node("gpu-a", gpus=2)], [])
    store.leading = True
    schedule = Schedule([], store.books.lock)
    monkeypatch.setattr(bounded, "decide", schedule.decide)
    try:
        await asyncio.gather(*(reconcile(store, obj, force=False) for obj in small))
        calls = {k: len(v) for k, v in schedule.decisions.items()}
        assert sum(calls.values()) <= len(small) + 1, calls
        assert store.books.stale <= 1
        assert sorted(store.books.ledger.deployments()) == sorted(f"default/s{i}" for i in range(8))
        assert store.books.ledger.over_budget() == []
    finally:
        await store.api.close()
        await cluster.api.close()
