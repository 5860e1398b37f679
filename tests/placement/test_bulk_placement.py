"""Bulk placement of many identical replicas (issue 32, core.placement.bulk): the same decision,
byte for byte, as placing replica after replica with a search and a booking each."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from placement_fakes import H100, bulk_and_one_by_one, check_invariant, clusters, fleets, node, request

from vllmfit.core import placement
from vllmfit.core.placement import bulk, place, search
from vllmfit.core.placement.decide import held_replicas
from vllmfit.sources import catalog

LLAMA_405B = catalog.model("meta-llama/Llama-3.1-405B-Instruct")

SPECS = [
    {"maxModelLen": 16384, "maxNumSeqs": 8},
    {"maxModelLen": 8192, "maxNumSeqs": 4, "placement": {"policy": "spread"}},
    {"maxModelLen": 4096, "maxNumSeqs": 2, "kvCache": {"concurrency": 2}},
    {"tensorParallelSize": 2, "maxModelLen": 32768, "maxNumSeqs": 16},
    {"tensorParallelSize": 2, "maxModelLen": 8192, "maxNumSeqs": 8, "placement": {"policy": "spread"}},
    {"tensorParallelSize": 4, "maxModelLen": 16384, "maxNumSeqs": 8, "maxNumBatchedTokens": 8192},
    {"maxModelLen": 8192, "maxNumSeqs": 8, "placement": {"nodeSelector": {"pool": "a"}}},
    {"tensorParallelSize": 2, "maxModelLen": 8192, "maxNumSeqs": 4,
     "placement": {"nodeSelector": {"pool": "b"}, "policy": "spread"}},
    {"maxNumSeqs": 4},  # maxModelLen unset: replica 0 may lower it; the others take replica 0's
    {"maxModelLen": 8192, "kvCache": {"grow": True}},  # replica 0's KV cache grows; the others take its size
    {"maxModelLen": 8192, "maxNumSeqs": 4, "gpuMemoryUtilization": 0.3},
]


def _fill(ledger: placement.Ledger, filled: int) -> None:
    for i in range(filled):  # some deployments booked, so that headroom differs GPU by GPU
        d = placement.decide(ledger, request(f"f{i}", maxModelLen=8192, maxNumSeqs=4 + 8 * i))
        if d.admitted:
            ledger.book(d)


@settings(max_examples=100, deadline=None)
@given(st.one_of(fleets(), clusters()), st.integers(0, 6), st.sampled_from(SPECS), st.integers(2, 40))
def test_bulk_equals_replica_by_replica(nodes, filled, spec, replicas) -> None:
    ledger = placement.Ledger(nodes)
    _fill(ledger, filled)
    fast, slow = bulk_and_one_by_one(ledger, request("x", **{**spec, "replicas": replicas}))
    assert fast == slow
    if fast.admitted:  # and it books: every GPU within budget
        ledger.book(fast)
        check_invariant(ledger)


@settings(max_examples=40, deadline=None)
@given(fleets(), st.integers(0, 4), st.sampled_from(SPECS[:6]), st.integers(1, 6), st.integers(2, 20))
def test_bulk_equals_replica_by_replica_when_scaling_up(nodes, filled, spec, before, after) -> None:
    """An UPDATE that adds replicas keeps the ones placed (decide's keep) and places the rest."""
    ledger = placement.Ledger(nodes)
    _fill(ledger, filled)
    d = placement.decide(ledger, request("x", **{**spec, "replicas": before}))
    if not d.admitted:
        return
    ledger.book(d)
    kept = held_replicas(ledger, "default/x", before, d.flags)
    fast, slow = bulk_and_one_by_one(ledger, request("x", **{**spec, "replicas": before + after}), keep=kept)
    assert fast == slow


def test_a_fitting_405b_with_many_replicas_is_placed_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica 0 is searched; the other 199 come from one bulk pass over the index, one per node
    (a TP 8 group of the 405B model takes more than half of each GPU), in node-name order."""
    ledger = placement.Ledger(node(f"n{i:03d}", H100, 8) for i in range(250))
    searches: list[int] = []
    real = place._search

    def counted(*a: object, **k: object) -> search._Candidate | None:
        searches.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(place, "_search", counted)
    req = request("big", LLAMA_405B, tensorParallelSize=8, quantization="fp8", maxModelLen=8192, replicas=200)
    d = placement.decide(ledger, req)
    assert d.admitted and len(searches) == 1
    assert [r.node for r in d.replicas] == [f"n{i:03d}" for i in range(200)]
    assert all(r.gpus == tuple(range(8)) for r in d.replicas)


def test_bulk_applies_only_to_settings_every_replica_shares() -> None:
    """Settings that fix every value (as replica 0's flags fix them for the others: place._same_as)."""
    fixed = {"maxModelLen": 8192, "maxNumSeqs": 4, "maxNumBatchedTokens": 8192, "kvCache": {"concurrency": 4}}
    assert bulk.applies(placement.settings_from_spec(request("x", **fixed).spec))
    assert not bulk.applies(placement.settings_from_spec(  # maxNumBatchedTokens lowered to fit
        request("w", **{**fixed, "maxNumBatchedTokens": None}).spec))
    assert not bulk.applies(placement.settings_from_spec(request("y", maxNumSeqs=4).spec))  # maxModelLen lowered
    assert not bulk.applies(placement.settings_from_spec(request("z", maxModelLen=8192, kvCache={"grow": True}).spec))


def test_best_fit_fills_the_tightest_node_first_then_the_next() -> None:
    """Three 0.5B-class replicas of one GPU each on two nodes, one with less room: best fit puts
    as many as fit on the tighter GPU, then goes on in index order (headroom, node, GPU)."""
    ledger = placement.Ledger([node("a", H100, 1, foreign={0: 60 << 30}), node("b", H100, 1)])
    req = request("r", catalog.model("Qwen/Qwen2.5-0.5B-Instruct"), maxModelLen=4096, maxNumSeqs=4, replicas=6)
    fast, slow = bulk_and_one_by_one(ledger, req)
    assert fast == slow and fast.admitted
    on_a = sum(r.node == "a" for r in fast.replicas)
    assert fast.replicas[0].node == "a" and on_a >= 2
    assert [r.node for r in fast.replicas] == ["a"] * on_a + ["b"] * (6 - on_a)


def test_a_gpu_left_with_exactly_one_more_replica_of_room_takes_it() -> None:
    """The boundary: after a replica, headroom equal to the need still fits (>=, as the search).
    Replica 0 is searched; replicas 1 and 2 are placed in bulk, the second one into exactly its room."""
    spec = {"maxModelLen": 8192, "maxNumSeqs": 4, "maxNumBatchedTokens": 8192, "kvCache": {"concurrency": 4}}
    req = request("r", **spec, replicas=4)
    need = search._full_sizing(req.model, placement.settings_from_spec(req.spec), H100).footprint.total
    budget = placement.Ledger([node("x", H100, 1)]).slot("x", 0).budget_bytes  # type: ignore[union-attr]
    ledger = placement.Ledger([node("a", H100, 1, foreign={0: budget - 3 * need}), node("b", H100, 1)])
    fast, slow = bulk_and_one_by_one(ledger, req)
    assert fast == slow and [r.node for r in fast.replicas] == ["a", "a", "a", "b"]
