"""Properties over random clusters and streams of changes (hypothesis).

After every step (create, delete, foreign use changing, a node leaving and replan) no GPU is over
budget, the books add up, the headroom indices match a recount, decide changes nothing, the
index search agrees with a direct scan, and plans do not depend on the order of their input.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from placement_fakes import A100_40, H100, L4, LLAMA_8B, QWEN_05B, QWEN_7B, check_invariant, node, request

from vllmfit.core import placement
from vllmfit.core.placement import search

GIB = 1 << 30
TYPES = (H100, A100_40, L4)
MODELS = (QWEN_05B, LLAMA_8B, QWEN_7B)

nodes_st = st.lists(
    st.tuples(
        st.sampled_from(range(3)),
        st.integers(1, 4),
        st.sampled_from([0, 4 * GIB, 30 * GIB]),
        st.sampled_from(["x", "y"]),
    ),
    min_size=1,
    max_size=4,
)
create_st = st.tuples(
    st.just("create"),
    st.sampled_from(range(3)),
    st.sampled_from([1, 1, 2]),
    st.sampled_from([None, 2048, 8192]),
    st.sampled_from([None, 1, 4]),
    st.sampled_from([1, 1, 2]),
    st.sampled_from([None, "n0", "n1"]),
    st.booleans(),
    st.sampled_from([None, "x"]),
    st.sampled_from(["bestFit", "spread"]),
)
ops_st = st.lists(
    st.one_of(
        create_st,
        create_st,
        st.tuples(st.just("delete"), st.integers(0, 30)),
        st.tuples(st.just("foreign"), st.integers(0, 3), st.sampled_from([0, 10 * GIB, 40 * GIB, 70 * GIB])),
        st.tuples(st.just("remove"), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=14,
)


def _cluster(spec: list[tuple[int, int, int, str]]) -> list[placement.NodeInfo]:
    return [
        node(f"n{i}", TYPES[t], count, {"pool": pool}, {0: foreign})
        for i, (t, count, foreign, pool) in enumerate(spec)
    ]


def _request(i: int, op: tuple) -> placement.Request:
    _, m, tp, length, seqs, replicas, pin, allow, pool, policy = op
    spec: dict = {"tensorParallelSize": tp, "replicas": replicas}
    if length:
        spec["maxModelLen"] = length
    if seqs:
        spec["maxNumSeqs"] = seqs
    place: dict = {"policy": policy, "allowReschedule": allow}
    if pin:
        place["nodeName"] = pin
    if pool:
        place["nodeSelector"] = {"pool": pool}
    return request(f"d{i}", MODELS[m], f"{i:03d}", placement=place, **spec)


def _snapshot(ledger: placement.Ledger) -> tuple:
    return (
        tuple((s.node, s.index, ledger.used_bytes(s.node, s.index)) for s in ledger.slots()),
        {k: list(v) for k, v in ledger._free.items()},
        {k: ledger.bookings_of(k) for k in ledger.deployments()},
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes_st, ops_st)
def test_no_gpu_is_ever_over_budget(cluster: list, ops: list) -> None:
    nodes = {n.name: n for n in _cluster(cluster)}
    ledger = placement.Ledger(nodes.values())
    requests: dict[str, placement.Request] = {}
    for i, op in enumerate(ops):
        if op[0] == "create":
            req = _request(i, op)
            before = _snapshot(ledger)
            d = placement.decide(ledger, req)
            assert _snapshot(ledger) == before, "decide changed the ledger"
            s = placement.settings_from_spec(req.spec)
            if not req.spec.placement.node_selector and len(ledger.nodes) and d.phase != "Rejected":
                for spread in (False, True):
                    fast = search._search(ledger, req, s, None, spread)
                    scan = search._search(ledger, req, s, ledger.node_set(ledger.nodes), spread)
                    assert fast == scan
            if d.admitted:
                ledger.book(d)
                requests[req.key] = req
        elif op[0] == "delete" and requests:
            key = sorted(requests)[op[1] % len(requests)]
            ledger.release(key)
            del requests[key]
        elif op[0] == "foreign":
            name = f"n{op[1]}"
            if name in ledger.nodes:
                old = ledger.nodes[name]
                gpus = tuple(
                    placement.GpuSlot(s.node, s.index, s.gpu, foreign_bytes=op[2] if s.index == 0 else 0)
                    for s in old.gpus
                )
                ledger.set_node(placement.NodeInfo(name, old.labels, gpus))
                _replan(ledger, requests)
        elif op[0] == "remove":
            name = f"n{op[1]}"
            if name in ledger.nodes and len(ledger.nodes) > 1:
                ledger.remove_node(name)
                _replan(ledger, requests)
        check_invariant(ledger)
        for key in ledger.deployments():
            assert all((b.node, b.index) in ledger._slots for b in ledger.bookings_of(key))


def _replan(ledger: placement.Ledger, requests: dict[str, placement.Request]) -> None:
    before = {k: ledger.bookings_of(k) for k in ledger.deployments()}
    r = placement.replan(ledger, requests)
    for key, bookings in before.items():  # who was not evicted did not move
        if key not in r.evicted:
            assert ledger.bookings_of(key) == bookings
    for key in r.waiting:
        if key in requests and not ledger.bookings_of(key):
            del requests[key]


@settings(max_examples=25, deadline=None)
@given(nodes_st, st.lists(create_st, min_size=1, max_size=10), st.randoms(use_true_random=False))
def test_a_plan_does_not_depend_on_input_order(cluster: list, creates: list, rnd: random.Random) -> None:
    nodes = _cluster(cluster)
    reqs = [_request(i, op) for i, op in enumerate(creates)]
    first = placement.to_json(placement.plan(nodes, reqs))
    rnd.shuffle(nodes)
    rnd.shuffle(reqs)
    assert placement.to_json(placement.plan(nodes, reqs)) == first
    check_invariant(placement.plan(nodes, reqs).ledger)
