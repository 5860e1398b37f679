"""The books (one of the operator's state objects, booking.state; issue 29): the writer's ledger,
its lock, the committed snapshot and its version, and the memory held for stopped replicas.

One writer: the ledger changes only while `Books.lock` is held; the lock's release publishes
`committed`, a frozen snapshot numbered by `version`. A change decided outside the lock names the
version it was decided on and is committed through `check`/`apply`, which raise `Stale` when the
ledger moved (docs/operator.md, "One writer, committed snapshots")."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from vllmfit.core import memory, placement
from vllmfit.core.placement import Ledger
from vllmfit.operator.booking import draining

T = TypeVar("T")


class Stale(Exception):
    """A change decided on a snapshot that is no longer the committed one: decide again."""


class _PublishingLock(asyncio.Lock):
    """The one writer's lock: each release publishes the ledger as the critical section left it
    (Books.publish), before anyone else can take the lock or read `Books.committed`."""

    def __init__(self, publish: Any) -> None:
        super().__init__()
        self._publish = publish

    def release(self) -> None:
        try:
            self._publish()
        finally:
            super().release()


class Books:
    """The books: the writer's ledger, its lock, the committed snapshot and its version, and
    the memory the ledger holds for stopped replicas (drains). One per operator process."""

    def __init__(self, kv_grant: memory.KvGrant = memory.DEFAULT_KV_GRANT) -> None:
        self.ledger = Ledger(kv_grant=kv_grant)  # the writer's: changes only under `lock`
        self.committed: Ledger = self.ledger.snapshot()  # what readers and reviews see
        self.version = 0  # counts the published changes (a decision names the one it saw)
        self._published: tuple[int, int] = (id(self.ledger), self.ledger.version)
        self.lock: asyncio.Lock = _PublishingLock(self.publish)
        self.ready = asyncio.Event()  # set once the start-up rebuild restored the ledger
        self.changes = 0  # critical sections entered through changing() (resync skips if it moved)
        self.drains = draining.Drains()  # stopped replicas whose pods may still hold memory
        self.refused: set[str] = set()  # nodes whose data was refused at start-up, not read well since
        self.stale = 0  # optimistic commits refused because the ledger moved (metrics, tests)
        self.deciding = 0  # reconciles between their first decision and their commit (`alone`)

    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[None]:
        """Hold the lock to change the ledger or the records (the release publishes them)."""
        async with self.lock:
            try:
                yield
            finally:
                self.changes += 1

    def publish(self) -> None:
        """Make the ledger as it is now the committed snapshot (when it changed). Called by the
        lock's release, and after the start-up rebuild; never while a change is half done."""
        now = (id(self.ledger), self.ledger.version)
        if now != self._published:
            self.committed = self.ledger.snapshot()
            self._published = (id(self.ledger), self.ledger.version)
            self.version += 1

    def alone(self) -> bool:
        """Whether one deciding reconcile is the only one: its decision on a snapshot can be
        committed only if nothing commits first, and another reconcile in flight will (a burst of
        creates: every optimistic decision but the first went Stale, each deployment was decided
        four times; issue 32). Not alone, a reconcile decides holding the lock."""
        return self.deciding <= 1

    def snapshot(self) -> Ledger:
        """The committed ledger: frozen, consistent, free to read from any thread. Its number is
        `self.version` read at the same moment (no await between the two reads)."""
        return self.committed

    def check(self, based_on: int) -> None:
        """Hold the lock. Raise Stale unless the writer's ledger is still the committed snapshot
        numbered `based_on` (the `version` read with `snapshot()`, no await between): nothing was
        published since, and nothing changed the ledger since the last publication."""
        if based_on != self.version or self._published != (id(self.ledger), self.ledger.version):
            self.stale += 1
            raise Stale(f"decided on version {based_on}; the ledger is at version {self.version}")

    async def apply(self, change: Callable[[Ledger], T], *, based_on: int | None = None) -> T:
        """The one writer's entry for a change decided outside the lock: take the lock; if
        `based_on` (the `version` of the snapshot the change was decided on) is no longer current,
        raise Stale (`check`: decide again on `snapshot()`); else run `change(ledger)` on the
        writer's ledger and publish it when the lock is released. `change` must not await (it is
        one step) and may raise (e.g. OverBudget): then nothing is published."""
        async with self.changing():
            if based_on is not None:
                self.check(based_on)
            return change(self.ledger)

    async def commit(self, decision: placement.Decision, based_on: int) -> None:
        """Book an admitted decision taken on the snapshot numbered `based_on` (apply)."""
        await self.apply(lambda ledger: ledger.book(decision), based_on=based_on)

    def misplaced(self, key: str, ledger: Ledger | None = None) -> bool:
        """Its bookings sit on a GPU that no longer exists or is over budget (in `ledger`: the
        writer's by default, or a snapshot). A node whose data was refused at start-up keeps what
        is booked on it, as a node refused live keeps its last good state: nothing on it is moved."""
        ledger = self.ledger if ledger is None else ledger
        for b in ledger.bookings_of(key):
            if b.node in self.refused:
                continue
            if ledger.slot(b.node, b.index) is None or ledger.headroom_bytes(b.node, b.index) < 0:
                return True
        return False
