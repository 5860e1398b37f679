"""replan: after a node vanished or filled up, only the deployments that must move do."""

from __future__ import annotations

from placement_fakes import H100, LLAMA_8B, QWEN_05B, check_invariant, node, request

from vllmfit.core import placement

SMALL = {"maxModelLen": 8192, "kvCache": {"concurrency": 8}}


def _admit(ledger: placement.Ledger, *reqs: placement.Request) -> dict[str, placement.Request]:
    for r in reqs:
        d = placement.decide(ledger, r)
        assert d.admitted, d.message
        ledger.book(d)
    return {r.key: r for r in reqs}


def test_a_removed_node_moves_only_its_deployments() -> None:
    ledger = placement.Ledger([node("a", H100, 1), node("b", H100, 2)])
    reqs = _admit(
        ledger,
        request("x", order="1", placement={"nodeName": "a"}, **SMALL),
        request("y", order="2", placement={"nodeName": "b"}, **SMALL),
    )
    y_before = ledger.bookings_of("default/y")
    assert ledger.remove_node("a") == ["default/x"]
    r = placement.replan(ledger, reqs)
    assert r.evicted == ["default/x"] and list(r.moves) == ["default/x"] and not r.waiting
    assert r.moves["default/x"].replicas[0].node == "b"
    assert r.moves["default/x"].moved  # pinned to a, allowReschedule (default) let it move
    assert ledger.bookings_of("default/y") == y_before
    check_invariant(ledger)


def test_grown_foreign_use_evicts_the_fewest() -> None:
    """Three on GPU 0; foreign use grows by less than the largest one needs: only it moves."""
    ledger = placement.Ledger([node("n", H100, 2)])
    reqs = _admit(
        ledger,
        request(
            "big",
            LLAMA_8B,
            "1",
            maxModelLen=32768,
            kvCache={"concurrency": 4},
            placement={"nodeName": "n", "gpuIndices": [0]},
        ),
        request(
            "s1",
            QWEN_05B,
            "2",
            maxModelLen=4096,
            kvCache={"concurrency": 4},
            placement={"nodeName": "n", "gpuIndices": [0]},
        ),
        request(
            "s2",
            QWEN_05B,
            "3",
            maxModelLen=4096,
            kvCache={"concurrency": 4},
            placement={"nodeName": "n", "gpuIndices": [0]},
        ),
    )
    free = ledger.headroom_bytes("n", 0)
    big = ledger.bookings_of("default/big")[0].footprint.total
    grown = free + big // 2  # over budget by big / 2: evicting `big` alone suffices, one small one does not
    assert ledger.set_node(node("n", H100, 2, foreign={0: grown})) == [
        "default/big",
        "default/s1",
        "default/s2",
    ]
    r = placement.replan(ledger, reqs)
    assert r.evicted == ["default/big"]
    assert r.moves["default/big"].replicas[0].gpus == (1,)
    assert [b.deployment for b in ledger.bookings_on("n", 0)] == ["default/s1", "default/s2"]
    check_invariant(ledger)


def test_what_cannot_move_waits_with_reasons() -> None:
    ledger = placement.Ledger([node("a", H100, 1), node("b", H100, 1)])
    reqs = _admit(
        ledger,
        request("x", order="1", maxModelLen=65536, kvCache={"concurrency": 6}),
        request("y", order="2", maxModelLen=65536, kvCache={"concurrency": 6}),
    )
    gone = ledger.bookings_of("default/x")[0].node
    ledger.remove_node(gone)
    r = placement.replan(ledger, reqs)
    assert not r.moves and list(r.waiting) == ["default/x"]
    w = r.waiting["default/x"]
    assert w.phase == "Unschedulable" and w.reasons and w.reasons[0].startswith("1 GPU memory (needs") and w.reasons[0].endswith(" on b GPU 0)")
    assert ledger.bookings_of("default/x") == []
    check_invariant(ledger)


def test_only_the_lost_replica_moves() -> None:
    ledger = placement.Ledger([node("a", H100, 1), node("b", H100, 1), node("c", H100, 1)])
    reqs = _admit(ledger, request("r", replicas=2, placement={"policy": "spread"}, **SMALL))
    before = {b.replica: (b.node, b.index) for b in ledger.bookings_of("default/r")}
    assert before == {0: ("a", 0), 1: ("b", 0)}
    ledger.remove_node("b")
    r = placement.replan(ledger, reqs)
    d = r.moves["default/r"]
    assert [(x.replica, x.node) for x in d.replicas] == [(0, "a"), (1, "c")]
    assert {b.replica: (b.node, b.index) for b in ledger.bookings_of("default/r")} == {
        0: ("a", 0),
        1: ("c", 0),
    }
    check_invariant(ledger)
