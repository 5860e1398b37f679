"""The closed loop's pure rules (vllmfit.core.placement.observed, vllmfit.core.memory.learned):
the booking rule and its floor, stability, the start gate, the learned correction. Every expected
figure is computed by hand from the rule's text, not by the code under test."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from placement_fakes import H100, QWEN_7B, check_indices, node, request

from vllmfit.core import defaults, memory, placement
from vllmfit.core.defaults import GIB, MIB
from vllmfit.core.errors import UserError
from vllmfit.core.memory import learned
from vllmfit.core.placement import observed
from vllmfit.core.placement.decision import Booking

MARGIN = defaults.OBSERVED_MARGIN_BYTES


def fp(total: int) -> memory.Footprint:
    return memory.Footprint(weights=total, kv_cache=0, activation=0, cuda_context=0, non_torch=0, cuda_graphs=0)


def ledger(*bookings: tuple[str, int, int, int], foreign: int = 0) -> placement.Ledger:
    """One node n of two H100s; bookings (deployment, replica, GPU, bytes)."""
    lg = placement.Ledger([node("n", H100, 2, foreign={0: foreign})])
    by: dict[str, list[Booking]] = {}
    for key, r, i, n in bookings:
        by.setdefault(key, []).append(Booking(key, r, "n", i, fp(n)))
    for key, bs in by.items():
        lg.restore(key, bs)
    return lg


def test_a_started_replica_books_observed_plus_margin_and_never_less_than_its_prediction() -> None:
    assert observed.booked(20 * GIB, 22 * GIB) == 22 * GIB + MARGIN
    assert observed.booked(20 * GIB, 19 * GIB) == 20 * GIB  # 19 GiB + 256 MiB < 20 GiB: the floor
    assert observed.booked(20 * GIB, 20 * GIB) == 20 * GIB + MARGIN
    lg = ledger(("a", 0, 0, 20 * GIB), ("b", 0, 0, 10 * GIB))
    ch = observed.change(lg, [observed.Measured("a", 0, "n", 0, 22 * GIB, True),
                              observed.Measured("b", 0, "n", 0, 30 * GIB, False)])  # b not started: unchanged
    assert set(ch.bookings) == {"a"}
    assert observed.apply(lg, ch) == []
    [a] = lg.bookings_of("a")
    assert (a.footprint.predicted, a.footprint.observed_excess, a.footprint.total) == (
        20 * GIB, 2 * GIB + MARGIN, 22 * GIB + MARGIN)
    assert lg.used_bytes("n", 0) == 32 * GIB + MARGIN
    [g] = ch.grown
    assert (g.before, g.after, g.observed, g.predicted) == (20 * GIB, 22 * GIB + MARGIN, 22 * GIB, 20 * GIB)
    # later it uses less: back to the floor, never below
    observed.apply(lg, observed.change(lg, [observed.Measured("a", 0, "n", 0, 5 * GIB, True)]))
    assert lg.bookings_of("a")[0].footprint.total == 20 * GIB
    check_indices(lg)


def test_a_gpu_pushed_over_budget_is_reported_with_who_holds_what_and_takes_no_newcomer() -> None:
    budget = placement.Ledger([node("n", H100, 1)]).slot("n", 0).budget_bytes
    lg = ledger(("a", 0, 0, 30 * GIB), ("b", 0, 0, budget - 30 * GIB - GIB), foreign=GIB // 2)
    assert lg.headroom_bytes("n", 0) == GIB // 2
    over = observed.apply(lg, observed.change(lg, [observed.Measured("a", 0, "n", 0, 31 * GIB, True)]))
    assert over == [("n", 0)]
    assert lg.headroom_bytes("n", 0) == GIB // 2 - GIB - MARGIN
    assert observed.holders(lg, "n", 0) == (
        f"n GPU 0 is {memory.fmt_gib(GIB + MARGIN - GIB // 2)} over its budget of {memory.fmt_gib(budget)}: "
        "a replica 0 holds 31.2 GiB (measured 31.0 GiB + margin, predicted 30.0 GiB); "
        f"b replica 0 holds {memory.fmt_gib(budget - 31 * GIB)} (as predicted); others (not vllmfit) hold 0.5 GiB")
    # a newcomer that fits GPU 1 goes there, never onto the over-budget GPU 0
    d = placement.decide(lg, request("c", QWEN_7B, maxModelLen=2048, kvCache={"concurrency": 1}))
    assert d.admitted and [b.index for b in d.bookings()] == [1]


@pytest.mark.parametrize(("previous", "current", "stable"), [
    (None, ("t1", 10 * GIB), False),  # one sample is not two
    (("t1", 10 * GIB), ("t1", 10 * GIB), False),  # the same sample seen twice
    (("t0", 10 * GIB), ("t1", 10 * GIB + 64 * MIB), True),  # within the jitter (inclusive)
    (("t0", 10 * GIB), ("t1", 10 * GIB + 65 * MIB), False),
    (("t0", 10 * GIB), ("t1", 10 * GIB - 64 * MIB), True),
    (("t0", 0), ("t1", 0), False),  # nothing measured
])
def test_a_footprint_is_stable_when_two_consecutive_samples_agree_within_the_jitter(
        previous: tuple[str, int] | None, current: tuple[str, int], stable: bool) -> None:
    assert defaults.FOOTPRINT_STABLE_BYTES == 64 * MIB
    assert observed.stable(previous, current) is stable


def _not_started(key: str, replica: int) -> bool:
    return False


def test_the_start_gate_needs_the_footprint_free_beside_what_replicas_not_started_need() -> None:
    lg = ledger(("a", 0, 0, 20 * GIB), ("b", 0, 0, 10 * GIB), ("c", 0, 1, 5 * GIB))
    # a needs 20; b (not started, its process already holds 4) still needs 6: 26 GiB
    gate = observed.start_gate(lg, "a", 0, {0: 26 * GIB, 1: 80 * GIB}, 10, _not_started, {("b", 0, 0): 4 * GIB})
    assert gate.open, gate.reason
    gate = observed.start_gate(lg, "a", 0, {0: 26 * GIB - 1, 1: 80 * GIB}, 10, _not_started, {("b", 0, 0): 4 * GIB})
    assert not gate.open
    assert gate.reason == "held: n GPU 0 has 26.0 GiB free (agent), this replica needs 20.0 GiB beside 6.0 GiB " \
                          "booked by replicas not started yet"
    # b has started: its use is in NVML's "used" already, a needs only its own footprint free
    gate = observed.start_gate(lg, "a", 0, {0: 20 * GIB}, 10, lambda k, r: k == "b")
    assert gate.open
    # a's own process already holds 15 GiB of its 20 (a pod that restarted): 5 GiB more is enough
    assert observed.start_gate(lg, "a", 0, {0: 5 * GIB}, 10, lambda k, r: k == "b", {("a", 0, 0): 15 * GIB}).open


def test_a_stale_or_missing_inventory_holds_the_gate_and_says_so() -> None:
    lg = ledger(("a", 0, 0, 20 * GIB))
    bound = defaults.START_GATE_MAX_AGE_SECONDS
    assert observed.start_gate(lg, "a", 0, {0: 80 * GIB}, bound, _not_started).open
    gate = observed.start_gate(lg, "a", 0, {0: 80 * GIB}, bound + 1, _not_started)
    assert not gate.open and gate.reason == (
        f"held: the agent's inventory of node n is {bound + 1} s old (more than {bound} s); waiting for a fresh one")
    assert "unreadable" in observed.start_gate(lg, "a", 0, {0: 80 * GIB}, None, _not_started).reason
    assert observed.start_gate(lg, "a", 0, {1: 80 * GIB}, 1, _not_started).reason == \
        "held: the agent's inventory of node n does not list GPU 0"
    no_agent = observed.start_gate(lg, "a", 0, None, None, _not_started)  # explicit: no agent on the node
    assert no_agent.open and "no agent inventory" in no_agent.reason
    assert not observed.start_gate(lg, "x", 0, {0: 80 * GIB}, 1, _not_started).open  # not booked
    moved = observed.start_gate(lg, "a", 0, {0: 80 * GIB}, 1, _not_started, made_for="n:1")
    assert not moved.open and "made for n:1" in moved.reason


@given(predicted=st.integers(0, 100 * GIB), samples=st.lists(st.integers(0, 100 * GIB), min_size=1, max_size=6))
def test_the_booking_follows_the_latest_sample_and_never_drops_below_the_prediction(
        predicted: int, samples: list[int]) -> None:
    lg = placement.Ledger([node("n", H100, 1)])
    lg.restore("a", [Booking("a", 0, "n", 0, fp(predicted))])
    for n in samples:
        observed.apply(lg, observed.change(lg, [observed.Measured("a", 0, "n", 0, n, True)]))
        assert lg.bookings_of("a")[0].footprint.total == max(predicted, n + MARGIN)
        assert lg.used_bytes("n", 0) == max(predicted, n + MARGIN)


# --- learned records --------------------------------------------------------------------------


def _settings(**kw: object) -> memory.Settings:
    return placement.settings_from_spec(request("x", QWEN_7B, maxModelLen=8192, **kw).spec)


def test_a_configuration_that_over_ran_is_booked_with_what_it_used_and_only_that_one() -> None:
    s = _settings(kvCache={"concurrency": 1})
    plain = memory.size(QWEN_7B, s, H100, memory.UNLIMITED)
    rec = learned.record(QWEN_7B.name, H100.product, s, plain.footprint.total, plain.footprint.total + 2 * GIB,
                         "ml/a replica 0 on n GPU 0")
    assert rec.config == learned.config_key(QWEN_7B.name, H100.product, s)
    assert rec.config == "Qwen/Qwen2.5-7B-Instruct|auto|NVIDIA-H100-80GB-HBM3|vllm 0.33|tp 1 pp 1|" \
                      "max_model_len=8192,kv_concurrency=1"
    table = learned.for_model([rec], QWEN_7B.name)
    fixed = memory.size(QWEN_7B, replace(s, learned=table), H100, memory.UNLIMITED)
    assert fixed.footprint.total == plain.footprint.total + 2 * GIB and fixed.footprint.learned == 2 * GIB
    assert fixed.flags == plain.flags  # vLLM's flags are unchanged: the over-run is booked, not granted
    assert "used 2.0 GiB more at its first start (ml/a replica 0 on n GPU 0; cluster-wide)" in fixed.warnings[-1]
    # another configuration (a different context), another GPU, another model: untouched
    other = _settings(kvCache={"concurrency": 2})
    assert memory.size(QWEN_7B, replace(other, learned=table), H100, memory.UNLIMITED).footprint.learned == 0
    assert learned.correction(QWEN_7B.name, "NVIDIA-L4", replace(s, learned=table)) is None
    assert learned.for_model([rec], "meta-llama/Llama-3.1-8B-Instruct") == ()
    # a decision books it: the ledger holds the observed figure
    d = placement.decide(placement.Ledger([node("n", H100, 1)]),
                         replace(request("y", QWEN_7B, maxModelLen=8192, kvCache={"concurrency": 1}), learned=table))
    assert d.admitted and d.bookings()[0].footprint.total == plain.footprint.total + 2 * GIB


def test_a_room_grant_with_a_learned_over_run_is_sized_to_the_room_the_over_run_leaves() -> None:
    # A KV cache that grows into the room (kv grant `room`, or kvCache.grow) must leave the learned
    # over-run its bytes: it is sized with available - over-run, then the over-run is booked on top.
    # On the old code it grew into the whole room first and the over-run pushed it over: Qwen2.5-7B
    # on an empty H100 under `room` with a 2 GiB record was refused (73.8 vs 71.8 GiB).
    lg = placement.Ledger([node("n", H100, 1)], kv_grant=memory.KvGrant("room"))
    req = request("q", QWEN_7B, maxModelLen=8192)
    s = placement.settings_from_spec(req.spec, "vllm", lg.kv_grant)
    available = lg.headroom_bytes("n", 0)
    plain = memory.size(QWEN_7B, s, H100, available)
    assert plain.fits and plain.footprint.kv_cache > 8 * GIB  # the room grant takes the room left
    rec = learned.record(QWEN_7B.name, H100.product, s, plain.footprint.total, plain.footprint.total + 2 * GIB, "q")
    table = learned.for_model([rec], QWEN_7B.name)
    fixed = memory.size(QWEN_7B, replace(s, learned=table), H100, available)
    assert fixed.fits, fixed.reasons
    assert fixed.footprint.learned == 2 * GIB and fixed.footprint.total <= available
    # the KV cache gave the over-run its room, in whole blocks: what vLLM is told is smaller
    assert fixed.footprint.kv_cache <= plain.footprint.kv_cache - 2 * GIB + 2 * MIB
    assert fixed.flags is not None and plain.flags is not None
    assert fixed.flags.kv_cache_memory_bytes == fixed.footprint.kv_cache
    d = placement.decide(lg, replace(req, learned=table))
    assert d.admitted, d.message
    assert d.bookings()[0].footprint.total <= available
    # with less room, the grown KV cache shrinks further: the over-run always keeps its bytes
    tight = memory.size(QWEN_7B, replace(s, learned=table), H100, plain.footprint.total + GIB)
    assert tight.fits and tight.footprint.kv_cache < plain.footprint.kv_cache


def test_a_refusals_fixes_size_with_the_learned_over_run_the_decision_books() -> None:
    """Issue 32: the decision, the replicas bound and the fixes size one Settings, learned over-runs
    included. A node under adr-0002 with room for 1 GiB less than the spec's prediction; `counted`
    holds back about 2.5 GiB less, so without a record the policy is the fix. With a 3 GiB over-run
    learned for this configuration, `counted` does not admit it either (checked by deciding on a node
    under `counted`), so no budget policy may be offered; nor may a replicas fix the cluster cannot hold."""
    adr = memory.POLICIES["adr-0002"]
    fixed = {"kvCache": {"concurrency": 1}, "maxNumSeqs": 8, "maxNumBatchedTokens": 8192}  # nothing to lower
    s = _settings(**fixed)
    need = memory.size(QWEN_7B, s, H100, memory.UNLIMITED).footprint.total
    foreign = adr.budget(H100.cuda_total_bytes) - (need - GIB)
    rec = learned.record(QWEN_7B.name, H100.product, s, need, need + 3 * GIB, "ml/a replica 0 on n GPU 0")
    req = request("y", QWEN_7B, maxModelLen=8192, replicas=2, **fixed)

    def refused(policy: memory.BudgetPolicy, r: placement.Request) -> placement.Decision:
        return placement.decide(placement.Ledger([node("n", H100, 2, foreign={0: foreign, 1: foreign},
                                                       policy=policy)]), r)

    plain = refused(adr, req)
    assert not plain.admitted and any(f.startswith("budget policy counted") for f in plain.suggestions)
    assert refused(memory.DEFAULT_POLICY, req).admitted  # that fix is right without the record
    taught = replace(req, learned=learned.for_model([rec], QWEN_7B.name))
    d = refused(adr, taught)
    assert not d.admitted
    assert not refused(memory.DEFAULT_POLICY, taught).admitted  # counted does not admit it with the over-run
    assert not [f for f in d.suggestions if f.startswith("budget policy")], d.suggestions
    assert all(not f.startswith("replicas:") for f in d.suggestions), d.suggestions


def test_a_start_that_used_less_never_unteaches_an_over_run_and_records_round_trip() -> None:
    s = _settings()
    big = learned.record(QWEN_7B.name, H100.product, s, 20 * GIB, 22 * GIB, "first")
    small = learned.record(QWEN_7B.name, H100.product, s, 20 * GIB, 19 * GIB, "second")
    assert learned.learn(learned.learn([], big), small) == [big]
    assert learned.learn([small], big) == [big]
    assert learned.for_model([small], QWEN_7B.name) == ()  # used less: nothing to correct
    assert learned.records_from_data({"records": [big.as_data()]}) == [big]
    assert learned.records_from_data([big.as_data()]) == [big]


@pytest.mark.parametrize(("data", "message"), [
    ("text", "expected a list of records"),
    ([1], "calibration record 0: not a mapping"),
    ([{"model": "m", "gpu": "g", "vllmVersion": "0.33", "tp": 1, "pp": 1, "predictedBytes": -1,
       "observedBytes": 1}], "predictedBytes must be an integer"),
    ([{"model": "m", "gpu": "g", "vllmVersion": "0.33", "tp": 0, "pp": 1, "predictedBytes": 1,
       "observedBytes": 1}], "tp must be an integer in 1..64"),
    ([{"model": "m", "gpu": "g", "vllmVersion": "0.33", "tp": 1, "pp": 1, "predictedBytes": 1,
       "observedBytes": True}], "observedBytes must be an integer"),
])
def test_bad_records_are_one_line(data: object, message: str) -> None:
    with pytest.raises(UserError, match=message):
        learned.records_from_data(data)


def test_floor_puts_one_nodes_bookings_back_to_their_prediction_and_change_restores_them() -> None:
    lg = ledger(("a", 0, 0, 20 * GIB))
    observed.apply(lg, observed.change(lg, [observed.Measured("a", 0, "n", 0, 30 * GIB, True)]))
    assert lg.used_bytes("n", 0) == 30 * GIB + MARGIN
    assert set(observed.floor(lg, "other").bookings) == set()
    observed.apply(lg, observed.floor(lg, "n"))
    assert lg.used_bytes("n", 0) == 20 * GIB and lg.bookings_of("a")[0].footprint.observed_excess == 0
    observed.apply(lg, observed.change(lg, [observed.Measured("a", 0, "n", 0, 30 * GIB, True)]))
    assert lg.used_bytes("n", 0) == 30 * GIB + MARGIN


def test_a_refusal_states_the_learned_figure_it_refused_on_and_who_taught_it() -> None:
    # a learned over-run is part of what a refused deployment needs: the reason says how much and
    # whence (on the old code it read only "needs at least 78.6 GiB, largest budget left 71.8 GiB")
    s = _settings(kvCache={"concurrency": 1})
    plain = memory.size(QWEN_7B, s, H100, memory.UNLIMITED)
    rec = learned.record(QWEN_7B.name, H100.product, s, plain.footprint.total, plain.footprint.total + 60 * GIB,
                         "ml/a replica 0 on n GPU 0", namespace="ml")
    d = placement.decide(placement.Ledger([node("n", H100, 1)]),
                         replace(request("y", QWEN_7B, maxModelLen=8192, kvCache={"concurrency": 1}),
                                 learned=learned.for_model([rec], QWEN_7B.name, "ml")))
    assert not d.admitted
    assert "(of it 60.0 GiB learned at a start: ml/a replica 0 on n GPU 0; namespace ml)" in " ".join(d.reasons)
    # the same configuration in another namespace is not corrected by it
    other = learned.for_model([rec], QWEN_7B.name, "other")
    assert other == () and learned.for_model([rec], QWEN_7B.name) != ()
