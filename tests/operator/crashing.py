"""An emulator whose operator can be killed at its k-th write (issue 14's crash tests), shared by
test_crash.py and test_crash_lifecycle.py (a helpers module: test modules never import each other)."""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import kmock
from opkit import TEST_AGENT, Cluster, Emulator, Operator

WRITES = frozenset({"POST", "PATCH", "PUT", "DELETE"})


@attrs.define(kw_only=True)
class Crashing(Emulator):
    """Counts the operator's writes; from the `kill_at`-th on, none reaches the store."""

    kill_at: int | None = None
    writes: int = 0
    killed: asyncio.Event = attrs.field(factory=asyncio.Event)
    thaw: asyncio.Event = attrs.field(factory=asyncio.Event)

    async def _handle(self, request: Any) -> Any:
        ours = request.headers.get("User-Agent") != TEST_AGENT
        if ours and str(request.method).upper().split(".")[-1] in WRITES:
            if self.killed.is_set() or (self.kill_at is not None and self.writes == self.kill_at):
                self.killed.set()
                await self.thaw.wait()
                # a dead process's requests fail (what it makes of it dies with it). 404, not 503:
                # Kopf retries 5xx for up to a minute, and a task of the stopping operator that
                # missed its cancellation (Python 3.11's asyncio.wait_for can swallow one) would
                # hold the stop that long; other 4xx escape Kopf's patching and are re-raised
                # when its tasks stop. A 404 is an answer every writer here takes in its stride.
                raise kmock.KubernetesError(status=404, reason="NotFound", message="operator killed")
            self.writes += 1
        return await self.serve(request)

    async def serve(self, request: Any) -> Any:
        """A request that reaches the store (the killed operator's writes never do)."""
        return await super()._handle(request)

    async def kill(self, op: Operator) -> None:
        """The operator process dies: its frozen writes fail, as every later write of it does,
        none reaching the store, and its task stops. The frozen writes are let go first: Kopf's
        stop waits for its tasks (its Event poster's too), so one blocked in a frozen request
        would hold the stop until they were let go."""
        self.thaw.set()
        await op.stop()

    async def restart(self, op: Operator, cluster: Cluster) -> None:
        """The killed operator is gone: let its frozen writes fail, forget the kill point, and start
        a new one on a fresh connection (what a pod restart does)."""
        self.kill_at = None
        self.thaw.set()
        self.killed = asyncio.Event()
        await cluster.reconnect()
        await op.start()
