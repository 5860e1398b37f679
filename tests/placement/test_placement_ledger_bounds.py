"""`Ledger.book` is the last line of defence when two reviews race for the last room on a GPU: it
must refuse a booking that is over a GPU's headroom by a single byte, and change nothing when it
refuses (issue 22 item 6: a mutant that let `book` accept up to 1 GiB over survived the suite).

Every expected number is computed here by hand from ADR-0002's budget policy, set explicitly on
every GPU (budget = int(0.90 x T) - 2 GiB, whatever the default policy is); the footprints are
synthetic bytes, so nothing depends on the memory model."""

from __future__ import annotations

import pytest
from placement_fakes import H100, check_invariant
from placement_fakes import node as _node

from vllmfit.core import memory, placement
from vllmfit.core.defaults import GIB
from vllmfit.core.placement.decision import Decision, ReplicaAllocation

# H100: T = 85031714816 (catalog); int(0.9 x T) = int(76528543334.4) = 76528543334; minus 2 GiB
# (2147483648) = 74381059686.
ADR_0002 = memory.BudgetPolicy(0.90, 2 * GIB, "test", context_bytes=0)
BUDGET = 74381059686
assert H100.cuda_total_bytes == 85031714816


def node(name: str, gpu: object, count: int, foreign: dict[int, int] | None = None) -> placement.NodeInfo:
    return _node(name, gpu, count, foreign=foreign, policy=ADR_0002)  # type: ignore[arg-type]
FOREIGN = 3 * 1024**3  # 3221225472 bytes used by a process vllmfit does not manage


def _fp(total: int) -> memory.Footprint:
    return memory.Footprint(weights=total, kv_cache=0, activation=0, cuda_context=0, non_torch=0, cuda_graphs=0)


def _decision(key: str, *replicas: tuple[str, tuple[int, ...], int]) -> Decision:
    """An admitted decision: per replica (node, GPUs, bytes booked on each GPU)."""
    allocs = []
    for r, (nd, gpus, total) in enumerate(replicas):
        sizing = memory.Sizing(fits=True, footprint=_fp(total), flags=None, kv_bytes_per_token=0,
                               kv_cache_tokens=0, max_concurrency=0.0)
        allocs.append(ReplicaAllocation(r, nd, gpus, sizing))
    return Decision(f"default/{key}", "Admitted", tuple(allocs))


def _state(ledger: placement.Ledger) -> tuple[object, ...]:
    return (
        [(s.node, s.index, ledger.used_bytes(s.node, s.index)) for s in ledger.slots()],
        {k: ledger.bookings_of(k) for k in ledger.deployments()},
    )


def test_a_booking_of_exactly_the_headroom_is_taken_and_leaves_zero() -> None:
    ledger = placement.Ledger([node("n", H100, 1)])
    ledger.book(_decision("a", ("n", (0,), BUDGET)))
    assert ledger.headroom_bytes("n", 0) == 0
    assert ledger.used_bytes("n", 0) == 74381059686
    check_invariant(ledger)


def test_one_byte_over_the_headroom_of_an_empty_gpu_is_refused() -> None:
    ledger = placement.Ledger([node("n", H100, 1)])
    with pytest.raises(placement.OverBudget, match="default/a no longer fits on n GPU 0"):
        ledger.book(_decision("a", ("n", (0,), BUDGET + 1)))
    assert ledger.deployments() == []
    assert ledger.headroom_bytes("n", 0) == 74381059686


def test_one_byte_over_after_foreign_use_is_refused() -> None:
    # headroom = 74381059686 - 3221225472 = 71159834214
    ledger = placement.Ledger([node("n", H100, 1, foreign={0: FOREIGN})])
    assert ledger.headroom_bytes("n", 0) == 71159834214
    with pytest.raises(placement.OverBudget):
        ledger.book(_decision("a", ("n", (0,), 71159834214 + 1)))
    ledger.book(_decision("a", ("n", (0,), 71159834214)))
    assert ledger.headroom_bytes("n", 0) == 0


def test_two_reviews_racing_for_the_last_room_the_second_is_refused_by_one_byte() -> None:
    """Both decisions were taken against the same empty ledger; once the first is booked, the
    second is one byte more than what is left."""
    ledger = placement.Ledger([node("n", H100, 1)])
    first = 40 * 1024**3  # 42949672960
    second = BUDGET - first + 1  # 74381059686 - 42949672960 + 1 = 31431386727
    assert second == 31431386727
    a = _decision("a", ("n", (0,), first))
    b = _decision("b", ("n", (0,), second))
    ledger.book(a)
    before = _state(ledger)
    with pytest.raises(placement.OverBudget):
        ledger.book(b)
    assert _state(ledger) == before
    ledger.book(_decision("b", ("n", (0,), second - 1)))
    assert ledger.headroom_bytes("n", 0) == 0
    check_invariant(ledger)


def test_a_tensor_parallel_group_one_byte_over_on_one_gpu_books_nothing() -> None:
    # GPU 1 carries 1 GiB of foreign use: its headroom is 74381059686 - 1073741824 = 73307317862
    ledger = placement.Ledger([node("n", H100, 2, foreign={1: 1024**3})])
    with pytest.raises(placement.OverBudget, match="on n GPU 1"):
        ledger.book(_decision("tp", ("n", (0, 1), 73307317862 + 1)))
    assert ledger.used_bytes("n", 0) == 0 and ledger.used_bytes("n", 1) == 1073741824
    assert ledger.deployments() == []
    ledger.book(_decision("tp", ("n", (0, 1), 73307317862)))
    assert (ledger.headroom_bytes("n", 0), ledger.headroom_bytes("n", 1)) == (74381059686 - 73307317862, 0)


def test_two_replicas_on_one_gpu_are_summed_before_the_check() -> None:
    # Two replicas of one decision on GPU 0: each half of the budget, one of them + 1 byte.
    half = BUDGET // 2  # 37190529843
    ledger = placement.Ledger([node("n", H100, 1)])
    with pytest.raises(placement.OverBudget):
        ledger.book(_decision("r", ("n", (0,), half), ("n", (0,), half + 1)))
    assert ledger.used_bytes("n", 0) == 0
    ledger.book(_decision("r", ("n", (0,), half), ("n", (0,), half)))
    assert ledger.used_bytes("n", 0) == 74381059686


def test_an_update_refused_by_one_byte_keeps_the_old_booking_exactly() -> None:
    """The update is checked without its own old booking (released first), and a refusal puts the
    old one back byte for byte."""
    ledger = placement.Ledger([node("n", H100, 1, foreign={0: FOREIGN})])
    ledger.book(_decision("other", ("n", (0,), 10 * 1024**3)))  # 10737418240
    ledger.book(_decision("u", ("n", (0,), 20 * 1024**3)))  # 21474836480
    # room for u's update: 74381059686 - 3221225472 - 10737418240 = 60422415974
    before = _state(ledger)
    with pytest.raises(placement.OverBudget):
        ledger.book(_decision("u", ("n", (0,), 60422415974 + 1)))
    assert _state(ledger) == before
    assert ledger.headroom_bytes("n", 0) == 60422415974 - 21474836480
    ledger.book(_decision("u", ("n", (0,), 60422415974)))
    assert ledger.headroom_bytes("n", 0) == 0
    check_invariant(ledger)


def test_a_booking_on_a_gpu_the_ledger_does_not_know_is_refused() -> None:
    ledger = placement.Ledger([node("n", H100, 1)])
    with pytest.raises(placement.OverBudget, match="on n GPU 1"):
        ledger.book(_decision("x", ("n", (1,), 1)))
    with pytest.raises(placement.OverBudget, match="on gone GPU 0"):
        ledger.book(_decision("x", ("gone", (0,), 1)))
    assert ledger.deployments() == []


def test_a_refused_decision_releases_nothing_else() -> None:
    """`book` of a non-admitted decision is a no-op: it does not release the deployment's booking."""
    ledger = placement.Ledger([node("n", H100, 1)])
    ledger.book(_decision("a", ("n", (0,), 1000)))
    ledger.book(Decision("default/a", "Pending"))
    assert ledger.used_bytes("n", 0) == 1000


# --- the accounting the search and the operator read -----------------------------------------------


def test_a_gpu_the_ledger_does_not_know_has_no_headroom_and_no_use() -> None:
    ledger = placement.Ledger([node("n", H100, 1, foreign={0: FOREIGN})])
    assert (ledger.used_bytes("n", 0), ledger.headroom_bytes("n", 0)) == (3221225472, 71159834214)
    assert (ledger.used_bytes("n", 1), ledger.headroom_bytes("n", 1)) == (0, 0)
    assert (ledger.used_bytes("gone", 0), ledger.headroom_bytes("gone", 0)) == (0, 0)


def test_release_gives_back_exactly_what_was_booked() -> None:
    ledger = placement.Ledger([node("n", H100, 2)])
    ledger.book(_decision("a", ("n", (0, 1), 1000)))
    ledger.book(_decision("b", ("n", (0,), 7)))
    released = ledger.release("default/a")
    assert sorted((b.index, b.footprint.total) for b in released) == [(0, 1000), (1, 1000)]
    assert (ledger.used_bytes("n", 0), ledger.used_bytes("n", 1)) == (7, 0)
    assert (ledger.headroom_bytes("n", 0), ledger.headroom_bytes("n", 1)) == (BUDGET - 7, BUDGET)
    assert ledger.release("default/a") == [] and ledger.release("default/nobody") == []
    assert ledger.deployments() == ["default/b"]
    check_invariant(ledger)


def test_a_gpu_pushed_over_its_budget_is_reported_with_the_deployments_on_it() -> None:
    """Foreign use that grows after admission: the GPU is over budget by one byte, and the
    deployments booked there are the ones to move (set_node's answer, affected, overfull)."""
    ledger = placement.Ledger([node("n", H100, 2)])
    ledger.book(_decision("a", ("n", (0,), 1000)))
    ledger.book(_decision("b", ("n", (1,), 1000)))
    assert ledger.set_node(node("n", H100, 2, foreign={0: BUDGET - 1000})) == []  # exactly full: fine
    assert ledger.headroom_bytes("n", 0) == 0
    assert ledger.over_budget() == [] and ledger.affected("n") == ledger.overfull_deployments("n") == []
    moved = ledger.set_node(node("n", H100, 2, foreign={0: BUDGET - 1000 + 1}))
    assert moved == ["default/a"]
    assert ledger.over_budget() == [("n", 0)]
    assert ledger.headroom_bytes("n", 0) == -1
    assert ledger.affected("n") == ledger.overfull_deployments("n") == ["default/a"]


def test_a_gpu_that_disappears_reports_what_was_booked_on_it() -> None:
    ledger = placement.Ledger([node("n", H100, 2)])
    ledger.book(_decision("a", ("n", (1,), 1000)))
    assert ledger.set_node(node("n", H100, 1)) == ["default/a"]  # GPU 1 is gone
    assert ledger.affected("n") == ["default/a"]
    assert ledger.remove_node("n") == ["default/a"]


def test_restore_is_unchecked_and_an_overfull_restore_shows_in_over_budget() -> None:
    ledger = placement.Ledger([node("n", H100, 1)])
    bookings = _decision("a", ("n", (0,), BUDGET + 1)).bookings()
    ledger.restore("default/a", bookings)
    assert ledger.used_bytes("n", 0) == 74381059687
    assert ledger.over_budget() == [("n", 0)]
    assert ledger.bookings_of("default/a") == bookings
    assert ledger.bookings_on("n", 0) == bookings


def test_a_copy_books_apart_from_the_original() -> None:
    ledger = placement.Ledger([node("n", H100, 1)])
    ledger.book(_decision("a", ("n", (0,), 1000)))
    twin = ledger.copy()
    twin.book(_decision("b", ("n", (0,), 2000)))
    twin.release("default/a")
    assert (ledger.used_bytes("n", 0), twin.used_bytes("n", 0)) == (1000, 2000)
    assert (ledger.deployments(), twin.deployments()) == (["default/a"], ["default/b"])
    check_invariant(ledger)
    check_invariant(twin)


def test_bookings_on_a_gpu_are_sorted_by_deployment_and_replica() -> None:
    ledger = placement.Ledger([node("n", H100, 1)])
    ledger.book(_decision("b", ("n", (0,), 1), ("n", (0,), 2)))
    ledger.book(_decision("a", ("n", (0,), 3)))
    assert [(b.deployment, b.replica, b.footprint.total) for b in ledger.bookings_on("n", 0)] == [
        ("default/a", 0, 3), ("default/b", 0, 1), ("default/b", 1, 2)]
    assert ledger.bookings_on("n", 5) == [] and ledger.bookings_on("x", 0) == []
