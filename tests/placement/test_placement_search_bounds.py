"""The search's choices at the edge of a fit (issue 22: survivors of the mutation run of
core/placement). `Index.first` and `_pick` are the two functions that pick a GPU (group) with room;
their inputs here are hand-made headroom lists and ledgers, so every expected pick is read off
the numbers. The end-to-end cases use ADR-0002's budget policy set on the GPUs."""

from __future__ import annotations

from placement_fakes import H100, LLAMA_8B, node, request

from vllmfit.core import memory, placement
from vllmfit.core.defaults import GIB
from vllmfit.core.placement.headroom import Index
from vllmfit.core.placement.search import _pick

ADR_0002 = memory.BudgetPolicy(0.90, 2 * GIB, "test", context_bytes=0)
BUDGET = 74381059686  # H100: int(0.9 x 85031714816) - 2 GiB

# (headroom, node, GPU index), sorted, as the ledger's free index holds them
ENTRIES = [(5, "a", 0), (10, "b", 0), (10, "c", 1), (20, "d", 0), (20, "e", 3)]


def _first(entries: list, need: int, spread: bool, allowed: frozenset[str] | None) -> object:
    return Index(entries).first(need, spread, allowed)


def test_best_fit_takes_the_least_headroom_that_still_fits() -> None:
    assert _first(ENTRIES, 10, False, None) == (10, "b", 0)  # exactly enough is enough
    assert _first(ENTRIES, 6, False, None) == (10, "b", 0)
    assert _first(ENTRIES, 5, False, None) == (5, "a", 0)
    assert _first(ENTRIES, 20, False, None) == (20, "d", 0)
    assert _first(ENTRIES, 21, False, None) is None
    assert _first(ENTRIES, 10, False, frozenset({"c", "e"})) == (10, "c", 1)
    assert _first(ENTRIES, 11, False, frozenset({"c", "e"})) == (20, "e", 3)
    assert _first(ENTRIES, 10, False, frozenset({"x"})) is None
    assert _first([], 0, False, None) is None


def test_spread_takes_the_most_headroom_then_the_first_name() -> None:
    assert _first(ENTRIES, 1, True, None) == (20, "d", 0)
    assert _first(ENTRIES, 20, True, None) == (20, "d", 0)  # exactly enough
    assert _first(ENTRIES, 21, True, None) is None
    assert _first([], 0, True, None) is None
    # among allowed nodes only: the most headroom there is 10 (b and c), b first
    allowed = frozenset({"b", "c"})
    assert _first(ENTRIES, 1, True, allowed) == (10, "b", 0)
    assert _first(ENTRIES, 10, True, allowed) == (10, "b", 0)  # exactly enough
    assert _first(ENTRIES, 11, True, allowed) is None
    assert _first(ENTRIES, 1, True, frozenset({"c"})) == (10, "c", 1)
    assert _first(ENTRIES, 1, True, frozenset({"a"})) == (5, "a", 0)
    assert _first(ENTRIES, 6, True, frozenset({"a"})) is None
    assert _first(ENTRIES, 1, True, frozenset({"x"})) is None


def _four(foreign: dict[int, int]) -> placement.Ledger:
    return placement.Ledger([node("n", H100, 4, foreign=foreign, policy=ADR_0002)])


def test_a_group_of_two_best_fit_takes_the_tightest_gpus_and_spread_the_roomiest() -> None:
    # headroom: GPU 0 B - 10 GiB, GPU 1 B, GPU 2 B - 5 GiB, GPU 3 B - 20 GiB (foreign use)
    ledger = _four({0: 10 * GIB, 2: 5 * GIB, 3: 20 * GIB})
    need = 1 << 30
    node_, gpus, _ = _pick(ledger, H100, 2, need, None, False)
    assert (node_, gpus) == ("n", (0, 3))  # B - 20 GiB and B - 10 GiB
    node_, gpus, key = _pick(ledger, H100, 2, need, None, True)
    assert (node_, gpus) == ("n", (1, 2))  # B and B - 5 GiB
    assert key == BUDGET - 5 * GIB  # the group's key: its second-largest headroom
    # a need only GPUs 1 and 2 meet: B - 5 GiB exactly
    assert _pick(ledger, H100, 2, BUDGET - 5 * GIB, None, False)[1] == (1, 2)
    assert _pick(ledger, H100, 2, BUDGET - 5 * GIB + 1, None, False) is None
    # the same through a node set (few nodes: scanned directly)
    few = ledger.node_set(["n"])
    assert _pick(ledger, H100, 2, need, few, True)[1] == (1, 2)
    assert _pick(ledger, H100, 1, BUDGET, few, False) == ("n", (1,), BUDGET)
    assert _pick(ledger, H100, 1, BUDGET + 1, few, False) is None


def test_a_gpu_type_that_cannot_run_the_spec_does_not_end_the_search() -> None:
    """An explicit `dtype: bfloat16` cannot run below compute capability 8.0 (vLLM's CudaPlatform):
    on a Turing-class GPU (7.5) named so that its type is searched first, the spec is an error;
    the search goes on to the H100 (every value set, so nothing is lowered instead)."""
    import dataclasses

    old = dataclasses.replace(H100, product="NVIDIA-A0-Turing", name="NVIDIA A0", compute_capability=(7, 5))
    ledger = placement.Ledger([node("t", old, 1, policy=ADR_0002), node("h", H100, 1, policy=ADR_0002)])
    assert [t.product for t in ledger.gpu_types()] == ["NVIDIA-A0-Turing", H100.product]
    d = placement.decide(ledger, request("x", model=LLAMA_8B, dtype="bfloat16", maxModelLen=8192, maxNumSeqs=4,
                                         maxNumBatchedTokens=8192))
    assert d.admitted, d.message
    assert [(r.node, r.gpus) for r in d.replicas] == [("h", (0,))]
    assert d.flags == d.replicas[0].sizing.flags and d.flags is not None


def test_a_pinned_group_names_its_tightest_gpu() -> None:
    """TP 2 pinned on GPUs [0, 1] of a node whose GPU 0 holds 70 GiB of foreign use: the refusal
    names GPU 0 (the tight one), not the last of the group."""
    ledger = placement.Ledger([node("n", H100, 2, foreign={0: 70 * GIB}, policy=ADR_0002)])
    spec = {"tensorParallelSize": 2, "maxModelLen": 8192, "maxNumSeqs": 4,
            "placement": {"nodeName": "n", "gpuIndices": [0, 1], "allowReschedule": False}}
    d = placement.decide(ledger, request("p", model=LLAMA_8B, **spec))
    assert not d.admitted
    text = " ".join((d.message, *d.reasons))
    assert "n: GPU 0 needs" in text and "GPU 1 needs" not in text


def test_restoring_bookings_on_a_node_not_yet_seen_is_kept_and_counted() -> None:
    """At start-up a status may be read before its node: the bookings are kept (unchecked) and
    counted once the node arrives."""
    ledger = placement.Ledger()
    d = placement.decide(placement.Ledger([node("n", H100, 1, policy=ADR_0002)]),
                         request("r", model=LLAMA_8B, maxModelLen=8192, maxNumSeqs=4))
    assert d.admitted
    ledger.restore("default/r", d.bookings())
    booked = d.replicas[0].sizing.footprint.total
    assert [b.footprint.total for b in ledger.bookings_on("n", 0)] == [booked]
    assert ledger.used_bytes("n", 0) == booked  # no slot yet: the booking alone
    ledger.set_node(node("n", H100, 1, policy=ADR_0002))
    assert ledger.headroom_bytes("n", 0) == BUDGET - booked
