"""An operator that stops leaves nothing of its state alive (issue 32, eighth round).

The start-up freezes what its rebuild made (`gc.freeze()` in `Store.rebuild`: full collections
skip the fleet's ledger from then on). Frozen objects are never collected, and what they reference
stays alive with them: a Store that stopped frozen kept every record it held until the process
ended. A process runs one operator, but the tests and `benchmarks/operator_scale.py --runs N` run
many, one after another, and kept every one of them (21 MB at 500 deployments on 100 nodes, and the
benchmark's peak RSS read 1.2 GB at 5,000 with three runs)."""

from __future__ import annotations

import gc
import weakref

import kopf
from opkit import node, vd

from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers import startup


async def test_the_cleanup_gives_back_what_the_rebuild_froze() -> None:
    store = Store()
    store.rebuild([node("n1")], [vd("a", maxModelLen=4096, maxNumSeqs=4)])
    assert gc.get_freeze_count() > 0  # the rebuilt ledger and records, out of the collector's reach
    ref, record = weakref.ref(store), weakref.ref(store.cache.records["default/a"])
    store.cache.records["default/a"].synced = (store,)  # a cycle through the store: only a collection frees it
    await startup.cleanup(memo=kopf.Memo(store=store))
    del store
    gc.collect()
    assert ref() is None and record() is None
    assert gc.get_freeze_count() == 0
