"""Bounded work per review (issue 32): a spec asking for more replicas than the cluster could hold
by the cheap bound (core.placement.summary.groups_bound) is refused before any search when that
bound is above defaults.SEARCHED_REPLICAS; the bound is never below what the search places."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from placement_fakes import H100, SPECS, fleets, node, request

from vllmfit.core import defaults, memory, placement
from vllmfit.core.placement import place
from vllmfit.core.placement.inputs import settings_from_spec
from vllmfit.core.placement.search import schedulable
from vllmfit.sources import catalog

LLAMA_405B = catalog.model("meta-llama/Llama-3.1-405B-Instruct")
WORST = {"tensorParallelSize": 8, "quantization": "fp8", "maxModelLen": 8192, "replicas": 1000}
H100_BUDGET = int(0.9 * 85031714816)  # counted: 0.9 x cudaMemGetInfo total (catalog/gpus.yaml), no reserve


def _cluster(nodes: int) -> placement.Ledger:
    return placement.Ledger(node(f"n{i:03d}", H100, 8) for i in range(nodes))


def test_a_405b_with_1000_replicas_is_refused_by_the_bound_before_any_search(monkeypatch) -> None:
    ledger = _cluster(150)
    req = request("worst", LLAMA_405B, **WORST)
    s = settings_from_spec(req.spec)
    need = place._min_need(req.model, s, H100)
    # one replica per GPU (more than half a budget each): each node holds exactly one TP 8 group
    assert H100_BUDGET // 2 < need <= H100_BUDGET
    assert place.replicas_bound(ledger, req, s, None)[0] == 150

    def no_search(*_a: object, **_k: object) -> None:
        raise AssertionError("searched")

    monkeypatch.setattr(place, "_place_replicas", no_search)
    d = placement.decide(ledger, req)
    assert d.phase == "Unschedulable" and d.replicas == ()
    assert d.reasons == (
        ("1000 replicas of 8 GPUs of one type on one node each do not fit: the GPUs of the 150 nodes have room "
         f"for at most 150 (at least {memory.fmt_gib(need)} on each NVIDIA-H100-80GB-HBM3)"),)
    # no `replicas: N` fix above SEARCHED_REPLICAS: checking it would place 150 groups
    assert not [f for f in d.suggestions if f.startswith("replicas:")]


def test_the_bound_is_exact_when_each_node_holds_one_group() -> None:
    ledger = _cluster(150)
    d = placement.decide(ledger, request("w", LLAMA_405B, **{**WORST, "replicas": 150}))
    assert d.admitted and len({r.node for r in d.replicas}) == 150


def test_below_searched_replicas_the_search_says_where_they_went() -> None:
    ledger = _cluster(defaults.SEARCHED_REPLICAS - 8)
    d = placement.decide(ledger, request("worst", LLAMA_405B, **WORST))
    n = defaults.SEARCHED_REPLICAS - 8
    assert d.message.startswith(f"{n}/1000 replicas placed; replica {n}: 0/{n} nodes are available: ")
    assert f"replicas: {n}" in d.suggestions  # checked: found at the first decision (the replicas placed)


@pytest.mark.parametrize("replicas", [2, 7, 40])
def test_shared_gpus_count_for_as_many_replicas_as_they_hold(replicas: int) -> None:
    """A GPU with room for k replicas counts k times (replicas share GPUs)."""
    ledger = placement.Ledger([node("a", H100, 1)])
    req = request("r", replicas=replicas, maxModelLen=16384, kvCache={"concurrency": 6})
    s = settings_from_spec(req.spec)
    bound = place.replicas_bound(ledger, req, s, None)[0]
    assert bound == H100_BUDGET // place._min_need(req.model, s, H100)
    placed = len(place._decide(ledger, req, "vllm", explain=False).replicas)
    assert placed <= bound


@settings(max_examples=80, deadline=None)
@given(fleets(), st.integers(0, 6), st.sampled_from(SPECS), st.integers(2, 40))
def test_no_search_places_more_replicas_than_the_bound(nodes, filled, spec, replicas) -> None:
    ledger = placement.Ledger(nodes)
    for i in range(filled):
        d = placement.decide(ledger, request(f"f{i}", maxModelLen=8192, maxNumSeqs=4 + 8 * i))
        if d.admitted:
            ledger.book(d)
    req = request("x", **{**spec, "replicas": replicas})
    s = settings_from_spec(req.spec)
    matching = schedulable(ledger, ledger.matching(req.spec.placement.node_selector), req.spec)
    bound = place.replicas_bound(ledger, req, s, matching)[0]
    d = place._decide(ledger, req, "vllm", explain=False)
    assert len(d.replicas) <= bound
