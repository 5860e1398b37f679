"""The ledger on small cases computed by hand (ADR policy: weights + KV, rounded up by u)."""

from __future__ import annotations

import pytest
from placement_fakes import H100, H100_BUDGET, H100_T, LLAMA_8B, check_invariant, request
from placement_fakes import node as _node

from vllmfit.core import memory, placement
from vllmfit.core.spec.api import GpuMemory, VLLMDeploymentStatus

# Llama-3.1-8B-Instruct, ADR-0002, maxModelLen 8192, maxNumSeqs 4, on an H100 (T = 85031714816):
#   weights = int(8030261248 params x 2 bytes x 1.02)                 = 16381732945
#   KV/token = 2 x 32 layers x 8 KV heads x (4096/32) head dim x 2 B  = 131072
#   KV       = 131072 x 8192 tokens x 4 sequences                     = 4294967296
#   need     = 16381732945 + 4294967296                               = 20676700241
#   u        = ceil(20676700241 x 10^4 / 85031714816) / 10^4 = ceil(2431.65) / 10^4 = 0.2432
#   footprint = R = ceil(85031714816 x 0.2432) = ceil(20679713043.2512) = 20679713044
WEIGHTS = 16381732945
KV = 4294967296
FOOTPRINT = 20679713044
SPEC = {"maxModelLen": 8192, "maxNumSeqs": 4}


def node(*args: object, **kw: object) -> placement.NodeInfo:
    """ADR-0002 memory formulas on ADR-0002's budget policy, by name (the `adr` memory policy's default)."""
    return _node(*args, policy=memory.ADR_POLICY, **kw)  # type: ignore[arg-type]


def test_budget_of_an_h100_is_ninety_percent_minus_two_gib() -> None:
    # adr-0002: 0.9 x 85031714816 = 76528543334.4 -> 76528543334; minus 2 GiB (2147483648) = 74381059686
    assert placement.GpuSlot("n", 0, H100, policy=memory.ADR_POLICY).budget_bytes == 74381059686 == H100_BUDGET
    assert memory.policy_named("adr-0002").budget(H100_T) == 74381059686
    # counted (the default): ceil(0.9 x 85031714816) = 76528543335, plus one CUDA context (0.55 GiB,
    # 590558003): what one vLLM at --gpu-memory-utilization 0.9 uses on the empty GPU
    assert placement.GpuSlot("n", 0, H100).budget_bytes == 76528543335 + 590558003 == 77119101338
    assert H100.cuda_total_bytes == H100_T


def test_three_fit_on_one_gpu_the_second_keeps_room_for_a_pair() -> None:
    p = placement.plan(
        [node("n", H100, 2)], [request(f"d{i}", order=str(i), **SPEC) for i in range(4)], policy="adr"
    )
    # Half the budget: 74381059686 / 2 = 37190529843. d0 leaves 74381059686 - 20679713044 =
    # 53701346642 on GPU 0; d1 there would leave 33021633598, no two GPUs above half (no room for a
    # TP 2 group), so d1 takes GPU 1 (53701346642 on each). From there no choice keeps a pair above
    # half: best fit, ties by index: d2 on GPU 0, d3 on GPU 0 (33021633598 >= 20679713044).
    assert [p.decisions[f"default/d{i}"].replicas[0].gpus for i in range(4)] == [(0,), (1,), (0,), (0,)]
    fp = p.decisions["default/d0"].replicas[0].sizing.footprint
    assert (fp.weights, fp.kv_cache, fp.total) == (WEIGHTS, KV, FOOTPRINT)
    assert p.decisions["default/d0"].flags.gpu_memory_utilization == 0.2432
    # GPU 0: 3 x 20679713044 = 62039139132 used; 74381059686 - 62039139132 = 12341920554 left,
    # less than one more footprint.
    assert p.ledger.used_bytes("n", 0) == 62039139132
    assert p.ledger.headroom_bytes("n", 0) == 12341920554
    assert p.ledger.headroom_bytes("n", 1) == H100_BUDGET - FOOTPRINT
    check_invariant(p.ledger)


def test_foreign_use_counts_against_the_budget() -> None:
    # 60 GiB foreign on GPU 0: 74381059686 - 64424509440 = 9956550246 left < 20679713044 -> GPU 1
    p = placement.plan([node("n", H100, 2, foreign={0: 60 << 30})], [request("d", **SPEC)], policy="adr")
    assert p.decisions["default/d"].replicas[0].gpus == (1,)
    assert p.ledger.used_bytes("n", 0) == 64424509440


def test_release_and_book_again_restore_the_same_numbers() -> None:
    ledger = placement.Ledger([node("n", H100, 1)])
    d = placement.decide(ledger, request("d", **SPEC), policy="adr")
    ledger.book(d)
    assert ledger.headroom_bytes("n", 0) == H100_BUDGET - FOOTPRINT
    released = ledger.release("default/d")
    assert [b.footprint.total for b in released] == [FOOTPRINT]
    assert ledger.headroom_bytes("n", 0) == H100_BUDGET
    ledger.restore("default/d", released)
    assert ledger.headroom_bytes("n", 0) == H100_BUDGET - FOOTPRINT
    check_invariant(ledger)


def test_book_refuses_a_stale_decision() -> None:
    ledger = placement.Ledger([node("n", H100, 1)])
    d1 = placement.decide(ledger, request("a", **SPEC), policy="adr")
    big = request("b", maxModelLen=131072, maxNumSeqs=3)  # 16381732945 + 3 x 17179869184 B KV
    d2 = placement.decide(ledger, big, policy="adr")
    assert d1.admitted and d2.admitted
    ledger.book(d2)
    with pytest.raises(placement.OverBudget):
        ledger.book(d1)
    assert ledger.deployments() == ["default/b"]
    check_invariant(ledger)


def test_an_update_is_checked_without_its_own_booking() -> None:
    ledger = placement.Ledger([node("n", H100, 1)])
    ledger.book(placement.decide(ledger, request("d", **SPEC), policy="adr"))
    again = placement.decide(ledger, request("d", maxModelLen=8192, maxNumSeqs=8), policy="adr")
    assert again.admitted and again.replicas[0].gpus == (0,)
    assert ledger.headroom_bytes("n", 0) == H100_BUDGET - FOOTPRINT  # decide changed nothing


def test_bookings_from_status_keep_the_operator_numbers() -> None:
    status = VLLMDeploymentStatus(
        phase="Running",
        memory=[
            GpuMemory(
                node="n",
                index=1,
                replica=0,
                weights_bytes=100,
                kv_cache_bytes=20,
                activation_bytes=3,
                overhead_bytes=4,
                total_bytes=130,
            )
        ],
    )
    (b,) = placement.bookings_from_status("ns/x", status)
    assert (b.node, b.index, b.footprint.total, b.footprint.overhead) == ("n", 1, 130, 7)  # 4 + 3 of slack


def test_set_node_reports_who_no_longer_fits_and_remove_node_who_lost_gpus() -> None:
    ledger = placement.Ledger([node("n", H100, 2)])
    for name in ("a", "b"):
        ledger.book(placement.decide(ledger, request(name, **SPEC), policy="adr"))
    # a on GPU 0, b on GPU 1 (a pair's room kept): 60 GiB of foreign use on each
    assert ledger.set_node(node("n", H100, 2, foreign={0: 60 << 30, 1: 60 << 30})) == ["default/a", "default/b"]
    assert ledger.remove_node("n") == ["default/a", "default/b"]
    assert ledger.slots() == []


def test_settings_from_spec_maps_every_memory_field() -> None:
    r = request(
        "d",
        maxModelLen=4096,
        maxNumSeqs=3,
        tensorParallelSize=2,
        pipelineParallelSize=1,
        kvCacheDtype="fp8",
        gpuMemoryUtilization=0.5,
        enforceEager=True,
        maxNumBatchedTokens=1024,
        image="vllm/vllm-openai:v0.15.1",
    )
    s = placement.settings_from_spec(r.spec, "adr")
    assert s == memory.Settings(
        tp=2,
        pp=1,
        kv_cache_dtype="fp8",
        max_model_len=4096,
        max_num_seqs=3,
        max_num_batched_tokens=1024,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        vllm_version="vllm/vllm-openai:v0.15.1",
        policy="adr",
    )
    assert LLAMA_8B.name == r.spec.model


def test_restore_replaces_what_the_key_had() -> None:
    """A status read back twice (a resync after a peer moved the replica) books where it says
    now, not also where it said before (Ledger.restore releases the key first)."""
    ledger = placement.Ledger([node("n", H100, 2)])
    fp = memory.Footprint(10 << 30, 0, 0, 0, 0, 0)
    ledger.restore("default/a", [placement.Booking("default/a", 0, "n", 0, fp)])
    ledger.restore("default/a", [placement.Booking("default/a", 0, "n", 1, fp)])
    assert [(b.node, b.index) for b in ledger.bookings_of("default/a")] == [("n", 1)]
    assert (ledger.used_bytes("n", 0), ledger.used_bytes("n", 1)) == (0, 10 << 30)


def test_a_replica_listed_twice_on_one_gpu_counts_once_and_leaves_nothing_when_released() -> None:
    """A status that lists one replica twice on one GPU (forged, or written by a bug) books it once,
    as the GPU's own books show it; releasing it leaves the GPU empty, not 10 GiB of phantom use
    (hypothesis found it: test_resync_mirror's resync then kept the phantom bytes)."""
    ledger = placement.Ledger([node("n", H100, 1)])
    small, large = memory.Footprint(10 << 30, 0, 0, 0, 0, 0), memory.Footprint(12 << 30, 0, 0, 0, 0, 0)
    ledger.restore("default/a", [placement.Booking("default/a", 0, "n", 0, fp) for fp in (small, large)])
    assert ledger.used_bytes("n", 0) == 12 << 30 == sum(b.footprint.total for b in ledger.bookings_on("n", 0))
    check_invariant(ledger)
    ledger.release("default/a")
    assert ledger.used_bytes("n", 0) == 0 and ledger.headroom_bytes("n", 0) == H100_BUDGET
    check_invariant(ledger)
