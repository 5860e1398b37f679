"""The books (one of the operator's state objects, booking.state; issue 29): the writer's ledger,
its lock, the committed snapshot and its version, and the memory held for stopped replicas.

One writer: every change of the ledger is a `transaction()` (or `apply`, one change decided
outside it): it takes the lock, works on a fork of the writer's ledger (`writing`), and either
commits all of it (the fork becomes the writer's ledger and is published as `committed`, a frozen
snapshot numbered by `version`) or, when anything in it raises or it is cancelled, none of it (the
fork is dropped: the writer's ledger and `committed` are what they were). A change decided outside
the lock names the version it was decided on and is committed through `apply`, which raises
`Stale` when the ledger moved (docs/operator.md, "One writer, committed snapshots")."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

from vllmfit.core import memory, placement
from vllmfit.core.placement import Ledger
from vllmfit.operator.booking import draining

T = TypeVar("T")


class Stale(Exception):
    """A change decided on a snapshot that is no longer the committed one: decide again."""


class Books:
    """The books: the writer's ledger, its lock, the committed snapshot and its version, and
    the memory the ledger holds for stopped replicas (drains). One per operator process."""

    def __init__(self, kv_grant: memory.KvGrant = memory.DEFAULT_KV_GRANT) -> None:
        self._ledger = Ledger(kv_grant=kv_grant)  # the writer's (`ledger`); changed only in a transaction
        self.committed: Ledger = self._ledger.snapshot()  # what readers and reviews see
        self.version = 0  # counts the published changes (a decision names the one it saw)
        self._published: tuple[Ledger, int] = (self._ledger, self._ledger.version)
        self.lock = asyncio.Lock()  # held by the open transaction (read `locked()`; take it through `transaction`)
        self._open: Ledger | None = None  # the open transaction's ledger before it (what a rollback restores)
        self._owner: object = None  # the task that opened it
        self.ready = asyncio.Event()  # set once the start-up rebuild restored the ledger
        self.changes = 0  # transactions entered (resync skips if it moved)
        self.drains = draining.Drains()  # stopped replicas whose pods may still hold memory
        self.refused: set[str] = set()  # nodes whose data was refused at start-up, not read well since
        self.stale = 0  # optimistic commits refused because the ledger moved (metrics, tests)
        self.deciding = 0  # reconciles between their first decision and their commit (`alone`)

    @property
    def ledger(self) -> Ledger:
        """The writer's ledger, to read on the operator's loop. Inside the open transaction (its
        own task) it is the transaction's ledger with its change so far; to every other task it
        is the ledger before that transaction, so no reader sees a change half done."""
        if self._open is not None and _task() is not self._owner:
            return self._open
        return self._ledger

    @ledger.setter
    def ledger(self, ledger: Ledger) -> None:  # tests set up a ledger directly; production: `replace`
        self._ledger = ledger

    @contextlib.asynccontextmanager
    async def transaction(self, *, counted: bool = True) -> AsyncIterator[Ledger]:
        """The one writer's entry: hold the lock, change the ledger it yields (`writing`: a fork
        of the writer's), and commit the whole change when the block ends: the fork becomes the
        writer's ledger and the committed snapshot (published only when it changed). An exception
        or a cancellation anywhere in the block rolls it back: nothing of it is kept or published.
        The records and caches the block changed are not rolled back; each handler changes them
        after the ledger step that may fail. `changes` counts it (`counted`) or, for a block that
        reads a consistent view or changes only caches the resync reads again, only when the
        ledger changed."""
        async with self.lock:
            before = self._ledger
            try:
                with self._opened() as work:
                    yield work
            finally:
                if counted or self._ledger is not before:
                    self.changes += 1

    @contextlib.contextmanager
    def step(self) -> Iterator[Ledger]:
        """A change with no await in it (the start-up rebuild, the resync's correction, a status
        adopted): part of the open transaction when its own task opened one, else a transaction of
        its own (on the loop, with no await, nothing can come between)."""
        if self._open is not None and _task() is self._owner:
            yield self._ledger
            return
        if self.lock.locked():
            raise RuntimeError("another task holds the ledger's transaction; take Books.transaction()")
        with self._opened() as work:
            yield work

    @contextlib.contextmanager
    def _opened(self) -> Iterator[Ledger]:
        base = self._ledger
        work = self._ledger = base.fork()
        self._open, self._owner = base, _task()
        try:
            yield work
        except BaseException:
            self._ledger = base  # roll back: the fork (and anything built on it) is dropped
            raise
        else:
            if self._ledger is work and work.version == base.version:
                self._ledger = base  # nothing changed: the fork is dropped, nothing is published
            self.publish()
        finally:
            self._open = self._owner = None

    changing = transaction  # the name most handlers use

    @property
    def writing(self) -> Ledger:
        """The open transaction's ledger, the only one production code changes; RuntimeError
        outside a transaction (or in a task that did not open it)."""
        if self._open is None or _task() is not self._owner:
            raise RuntimeError("the ledger changes only inside Books.transaction()")
        return self._ledger

    def replace(self, ledger: Ledger) -> None:
        """Inside a transaction: make `ledger` (built apart, e.g. a fork re-planned in a thread,
        a rebuild from the API) the transaction's result; committed with it, or dropped."""
        if self._open is None or _task() is not self._owner:
            raise RuntimeError("the ledger is replaced only inside Books.transaction()")
        self._ledger = ledger

    def publish(self) -> None:
        """Make the writer's ledger as it is now the committed snapshot (when it changed since the
        last publication). A transaction's commit calls it; never while a change is half done."""
        if self._published != (self._ledger, self._ledger.version):
            self.committed = self._ledger.snapshot()
            self._published = (self._ledger, self._ledger.version)
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
        if based_on != self.version or self.ledger.version != self.committed.version:
            self.stale += 1
            raise Stale(f"decided on version {based_on}; the ledger is at version {self.version}")

    async def apply(self, change: Callable[[Ledger], T], *, based_on: int | None = None) -> T:
        """The one writer's entry for a change decided outside the lock: take the lock; if
        `based_on` (the `version` of the snapshot the change was decided on) is no longer current,
        raise Stale (`check`: decide again on `snapshot()`); else run `change(ledger)` on the
        writer's ledger and publish it when the lock is released. `change` must not await (it is
        one step) and may raise (e.g. OverBudget): then nothing of it is kept or published."""
        async with self.transaction() as ledger:
            if based_on is not None:
                self.check(based_on)
            return change(ledger)

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


def _task() -> object:
    """The asyncio task running now (None outside one: a step at start-up, a test)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None
