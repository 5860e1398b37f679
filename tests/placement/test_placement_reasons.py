"""Refusals grouped by cause like the kube-scheduler's FitError ("0/N nodes are available: <count>
<reason>, ... ."), with the best candidate's numbers. Expected text written by hand for a few
clusters; the numbers in it are checked against the memory model and the counted budgets below."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from placement_fakes import H100, L4, LLAMA_8B, SPECS, clusters, fleets, node, request

from vllmfit.core import memory, placement
from vllmfit.core.defaults import GIB
from vllmfit.core.placement import reasons
from vllmfit.core.placement.inputs import settings_from_spec

FIXED = {"maxModelLen": 16384, "maxNumSeqs": 8, "maxNumBatchedTokens": 8192, "kvCache": {"concurrency": 8}}  # nothing to lower: "needs"


def test_twenty_nodes_two_causes_like_the_issue_says() -> None:
    nodes = [node(f"l4-{i:02d}", L4, 1, labels={"pool": "gpu"}) for i in range(12)]
    nodes += [node(f"h100-{i}", H100, 1, labels={"pool": "other"}) for i in range(8)]
    ledger = placement.Ledger(nodes)
    d = placement.decide(ledger, request("d", placement={"nodeSelector": {"pool": "gpu"}}, **FIXED))
    assert d.message == (
        "0/20 nodes are available: 12 GPU memory (needs 34.7 GiB, largest budget left 20.3 GiB on l4-00 GPU 0), "
        "8 node(s) didn't match placement.nodeSelector. Fits with: placement.nodeSelector: remove (fits on h100-0); "
        "or kvCacheDtype: fp8, kvCache.concurrency: 1; or kvCacheDtype: fp8, kvCache: {tokens: 27760}; "
        "or kvCacheDtype: fp8, maxModelLen: 3456; or quantization: fp8, kvCache.concurrency: 4; "
        "or quantization: fp8, kvCache: {tokens: 67120}; or quantization: fp8, maxModelLen: 8384; "
        "or kvCacheDtype: fp8, quantization: fp8"
    )
    # fewer requests of the 16384-token context first: the most that fit the largest token count
    assert (27760 // 16384, 67120 // 16384) == (1, 4)
    # the fixes, against ADR-0002's budget (46224 tokens with fp8 weights): counted hands out
    # ceil(0.9 T) + 0.55 GiB - (int(0.9 T) - 2 GiB) more, as KV tokens of 131072 B, within a block and
    # u's rounding step
    more = (math.ceil(0.9 * 23616028672) + int(0.55 * GIB)) - (int(0.9 * 23616028672) - 2 * GIB)
    assert abs((67120 - 46224) * 131072 - more) < 16 * 131072 + 23616028672 // 10_000
    # no budget policy line: 34.7 GiB needed against 20.3 GiB is far more than the 1.6 GiB the policy
    # holds back of an L4 (issue 31: the policy is named only where it is the cause)
    assert d.reasons == (
        "12 GPU memory (needs 34.7 GiB, largest budget left 20.3 GiB on l4-00 GPU 0)",
        "8 node(s) didn't match placement.nodeSelector",
    )
    # the numbers: 34.7 GiB is the memory model's footprint (with the measured 1.02 GiB dense KV margin on
    # 0.33, issue 13); 20.3 GiB is an L4's counted budget, ceil(0.9 x 23616028672) + 0.55 GiB = 21844983808
    # bytes (ADR-0002's: 19106942156, 17.8 GiB)
    s = placement.settings_from_spec(request("d", **FIXED).spec)
    assert memory.fmt_gib(memory.size(LLAMA_8B, s, L4, 1 << 60).footprint.total) == "34.7 GiB"
    assert L4.cuda_total_bytes == 23616028672
    assert math.ceil(0.9 * 23616028672) + int(0.55 * GIB) == 21844983808 and f"{21844983808 / GIB:.1f}" == "20.3"
    assert 23616028672 - 21844983808 == 1771044864 and f"{1771044864 / GIB:.1f}" == "1.6"  # held back


def test_the_best_candidate_is_the_node_with_the_most_room() -> None:
    foreign = {0: 10 * GIB}
    ledger = placement.Ledger([node("a", L4, 1, foreign=foreign), node("b", L4, 1), node("c", L4, 1, foreign=foreign)])
    d = placement.decide(ledger, request("d", **FIXED))
    # b is empty: 20.3 GiB; a and c lose 10 GiB to a foreign process (10.3 GiB)
    assert d.message.startswith("0/3 nodes are available: 3 GPU memory (needs 34.7 GiB, largest budget left 20.3 GiB on b GPU 0).")


def test_groups_need_enough_gpus_and_gpuless_nodes_are_counted() -> None:
    ledger = placement.Ledger([node("cpu", [], 0), node("a", H100, 1), node("b", L4, 1)])
    d = placement.decide(ledger, request("tp2", tensorParallelSize=2, maxModelLen=8192, maxNumSeqs=8, kvCache={"concurrency": 8},
                                         maxNumBatchedTokens=8192))
    assert d.message == (
        "0/3 nodes are available: 1 node(s) had no GPUs, 2 node(s) had fewer than 2 GPUs of one type (at most 1). "
        "Needs 2 GPUs (tensorParallelSize 2 x pipelineParallelSize 1); nodes have at most 1 GPUs of one "
        "type, and a replica across nodes keeps each tensor-parallel group of 2 GPUs on one node."
    )  # too few GPUs is not the budget policy's doing: no policy sentence (issue 31)


def test_a_tensor_parallel_group_names_its_best_gpus() -> None:
    ledger = placement.Ledger([node("a", L4, 2), node("b", L4, 4, foreign={1: 2 * GIB, 3: 4 * GIB})])
    d = placement.decide(ledger, request("tp2", tensorParallelSize=2, maxModelLen=131072, maxNumSeqs=16, kvCache={"concurrency": 16},
                                         maxNumBatchedTokens=8192))
    # a's two GPUs and b's two emptiest (0 and 2) all have the whole 20.3 GiB; a sorts first. 142 GiB
    # short is not the policy's doing (it holds back 1.6 GiB of an L4): no policy sentence
    assert d.message.startswith("0/2 nodes are available: 2 GPU memory (needs ")
    assert " on each of 2 GPUs, the best 2 have 20.3 GiB or more left each: a GPU 0,1). Fits with: maxModelLen: " \
        in d.message


def test_node_affinity_exclusions_are_named_by_the_field_that_excludes() -> None:
    ledger = placement.Ledger([node("a", L4, 1, labels={"zone": "x"}), node("b", L4, 1, labels={"zone": "y"})])
    affinity = {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["y"]}]}]}}}}}
    d = placement.decide(ledger, request("d", podTemplate=affinity, **FIXED))
    assert d.message.startswith(
        "0/2 nodes are available: 1 GPU memory (needs 34.7 GiB, largest budget left 20.3 GiB on b GPU 0), "
        "1 node(s) didn't match the podTemplate node affinity."
    )


def test_a_pinned_node_keeps_its_own_line() -> None:
    ledger = placement.Ledger([node("a", L4, 1)])
    d = placement.decide(ledger, request("d", placement={"nodeName": "a", "allowReschedule": False}, **FIXED))
    assert d.message.startswith("pinned placement does not fit: a: GPU 0 needs 34.7 GiB, 20.3 GiB of budget left. Fits")


# --- the indexed path gives exactly the node-by-node causes -----------------------------------------


@settings(max_examples=60, deadline=None)
@given(clusters(), st.integers(0, 5), st.sampled_from(SPECS))
def test_indexed_causes_equal_node_by_node_causes(nodes, filled, spec) -> None:
    ledger = placement.Ledger(nodes)
    for i in range(filled):  # some deployments booked, to make headroom differ
        d = placement.decide(ledger, request(f"f{i}", maxModelLen=8192, maxNumSeqs=4 + 8 * i))
        if d.admitted:
            ledger.book(d)
    req = request("x", **spec)
    s = settings_from_spec(req.spec)
    matching = ledger.matching(req.spec.placement.node_selector)
    fast = reasons._why_not(ledger, req, s, matching, indexed=True)
    slow = reasons._why_not(ledger, req, s, matching, indexed=False)
    assert fast == slow


# --- counted from the node set's summary (issue 32): single-type nodes, policies, taints ------------


@settings(max_examples=80, deadline=None)
@given(fleets(), st.integers(0, 6), st.sampled_from(SPECS))
def test_counted_causes_equal_node_by_node_causes_on_node_pools(nodes, filled, spec) -> None:
    ledger = placement.Ledger(nodes)
    for i in range(filled):
        d = placement.decide(ledger, request(f"f{i}", maxModelLen=8192, maxNumSeqs=4 + 8 * i))
        if d.admitted:
            ledger.book(d)
    req = request("x", **spec)
    s = settings_from_spec(req.spec)
    from vllmfit.core.placement.search import schedulable

    matching = schedulable(ledger, ledger.matching(req.spec.placement.node_selector), req.spec)
    slow = reasons._why_not(ledger, req, s, matching, indexed=False)
    assert reasons._why_not(ledger, req, s, matching, indexed=True) == slow
    assert reasons._why_not(ledger, req, s, matching, indexed=True) == slow  # from the cached summary


# --- kept as nodes change (issue 32): the census and the most GPUs of one type, on forks too -------


def _walked(ledger) -> tuple[dict, int, dict]:
    """What the ledger counts as nodes change, walked node by node instead: the census of a ledger
    built afresh from the same nodes, the most GPUs of one type on a node, and per type."""
    fresh = placement.Ledger(ledger.nodes.values())
    per_type: dict = {}
    for nd in ledger.nodes.values():
        for t in {sl.gpu for sl in nd.gpus if not sl.mig}:
            per_type[t] = max(per_type.get(t, 0), sum(1 for sl in nd.gpus if sl.gpu == t and not sl.mig))
    return ({w: fresh.census.of(w) for w in (False, True)}, max(per_type.values(), default=0), per_type)


@settings(max_examples=60, deadline=None)
@given(fleets(), fleets(), st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=12),
       st.sampled_from(SPECS))
def test_counts_kept_as_nodes_change_equal_a_walk_and_snapshots_keep_theirs(nodes, others, changes, spec) -> None:
    ledger = placement.Ledger(nodes)
    before = ledger.snapshot()
    expected_before = _walked(before)
    ledger = ledger.fork()
    for remove, k in changes:  # nodes replaced by another fleet's (other GPUs, errors, taints) or removed
        if remove:
            ledger.remove_node(f"n{k:02d}")
        elif others:
            other = others[k % len(others)]
            ledger.set_node(dataclasses.replace(other, name=f"n{k:02d}", gpus=tuple(
                dataclasses.replace(sl, node=f"n{k:02d}") for sl in other.gpus)))
    census, most, per_type = _walked(ledger)
    assert {w: ledger.census.of(w) for w in (False, True)} == census
    assert ledger.most_of_one_type() == most
    assert set(ledger.census.refusing) == {n for n, nd in ledger.nodes.items() if nd.taints or nd.unschedulable}
    assert all(ledger.most_of_one_type(t) == n for t, n in per_type.items())
    assert {w: before.census.of(w) for w in (False, True)} == expected_before[0]  # the snapshot is as it was
    assert before.most_of_one_type() == expected_before[1]
    req = request("x", **spec)
    s = settings_from_spec(req.spec)
    from vllmfit.core.placement.search import schedulable

    matching = schedulable(ledger, ledger.matching(req.spec.placement.node_selector), req.spec)
    assert reasons._why_not(ledger, req, s, matching, indexed=True) == \
        reasons._why_not(ledger, req, s, matching, indexed=False)
