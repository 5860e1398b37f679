"""The core's own safety arithmetic, against numbers computed here from vLLM's code (issue 22
item 6: mutants of these two rules survived the whole suite).

1. `utilization_within(T, room)`: the --gpu-memory-utilization a vLLM that must start in `room`
   free bytes may be given. vLLM refuses to start when free memory < requested memory, where
   requested memory is `math.ceil(total_memory * gpu_memory_utilization)` (vllm/v1/worker/utils.py
   request_memory, 0.15+; before, the float `total * u` itself, which is never more). So the rule is
   ceil(T x u) <= room, not one byte more, and u is the largest 4-decimal value that keeps it.
2. The blocks one request holds in a sliding-window group: vLLM's
   SlidingWindowSpec.max_memory_usage_bytes (vllm/v1/kv_cache_interface.py) is
   (cdiv(min(sliding_window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1) pages;
   0.33 keeps F = (PP + 1) x B tokens in flight instead of B (vllm-memory-accounting.md section 11).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllmfit.core.defaults import GIB
from vllmfit.core.limits import MAX_GPU_MEMORY_BYTES
from vllmfit.core.memory import (
    BudgetPolicy,
    KvLayout,
    VllmVersion,
    budget_bytes,
    requested_bytes,
    utilization_for,
    utilization_within,
)

H100_T = 85031714816  # catalog/gpus.yaml cuda_total_bytes

# --- utilization_within -------------------------------------------------------------------------
# By hand (exact decimal products):
#   T x 0.2432 = 85031714816 x 2432 / 10^4 = 20679713043.2512 -> requested 20679713044
#   T x 0.2431 = 85031714816 x 2431 / 10^4 = 20671209871.7696 -> requested 20671209872
#   T x 0.5    = 42515857408 exactly                         -> requested 42515857408
#   T x 0.9999 = 85023211644.5184                            -> requested 85023211645


@pytest.mark.parametrize(
    ("room", "u"),
    [
        (20679713044, 0.2432),  # exactly vLLM's request at 0.2432
        (20679713043, 0.2431),  # one byte less: 0.2432 would not start
        (20679713043 - (1 << 20), 0.2431),  # a MiB less: still above 0.2431's 20671209872
        (20671209872, 0.2431),
        (20671209871, 0.2430),  # one byte under 0.2431's request
        (42515857408, 0.5),
        (42515857407, 0.4999),
        (H100_T, 1.0),
        (H100_T - 1, 0.9999),
        (85023211645, 0.9999),
        (85023211644, 0.9998),
        (0, 0.0),
        (-GIB, 0.0),
        (2 * H100_T, 1.0),
    ],
)
def test_utilization_within_an_h100_by_hand(room: int, u: float) -> None:
    assert utilization_within(H100_T, room) == u


def test_utilization_within_where_float_division_rounds_up_to_the_next_step() -> None:
    """A 2 TiB GPU (limits.MAX_GPU_MEMORY_BYTES accepts it) where room x 10^4 / T is 9999 in floats
    although it is 9999 - 1/T exactly: 0.9999 would ask for one byte more than the room.
      T x 9999 = 21988031576930001 -> T x 0.9999 = 2198803157693.0001 -> requested 2198803157694
      T x 9998 = 21985832553870002 -> T x 0.9998 = 2198583255387.0002 -> requested 2198583255388"""
    capacity, room = 2199023059999, 2198803157693
    assert room * 10**4 / capacity == 9999.0  # the float quotient a floor alone would trust
    assert utilization_within(capacity, room) == 0.9998
    assert utilization_within(capacity, room + 1) == 0.9999


def _requested(total: int, u: float) -> int:
    """vLLM's request_memory: math.ceil(total_memory * gpu_memory_utilization) (float product)."""
    return math.ceil(total * u)


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1 * GIB, MAX_GPU_MEMORY_BYTES),
    fraction=st.floats(0, 1.2, allow_nan=False),
    jitter=st.integers(-(1 << 21), 1 << 21),
)
def test_utilization_within_never_requests_one_byte_more_than_the_room(
    capacity: int, fraction: float, jitter: int
) -> None:
    room = int(capacity * fraction) + jitter
    u = utilization_within(capacity, room)
    assert 0.0 <= u <= 1.0
    assert round(u, 4) == u
    if u > 0:
        assert _requested(capacity, u) <= room  # vLLM starts in that room
        assert int(capacity * u) <= room  # vLLM before 0.15 (no ceil) too
    # and it is the largest such u: one step more asks for more than the room
    if u < 1.0:
        assert _requested(capacity, round(u + 0.0001, 4)) > room


# --- the budget and vLLM's request -------------------------------------------------------------
# ADR-0002 on an H100: int(0.9 x 85031714816) = int(76528543334.4) = 76528543334; - 2 GiB = 74381059686.


def test_budget_bytes_by_hand_and_never_negative() -> None:
    assert budget_bytes(H100_T, 0.9, 2 * GIB) == 74381059686
    assert budget_bytes(H100_T, 0.9, 0) == 76528543334
    assert budget_bytes(H100_T, 1.0, 0) == H100_T
    assert budget_bytes(H100_T, 0.0, 0) == 0
    assert budget_bytes(H100_T, 0.01, 2 * GIB) == 0  # 850317148 - 2147483648 < 0 -> 0
    assert budget_bytes(H100_T, 0.9, 76528543334) == 0  # the reserve takes all of it, exactly
    assert budget_bytes(H100_T, 0.9, 76528543333) == 1


def test_a_budget_policy_hands_out_its_budget_and_holds_back_the_rest() -> None:
    p = BudgetPolicy(0.9, 2 * GIB, "test", context_bytes=0)  # ADR-0002's figures
    assert p.budget(H100_T) == 74381059686
    assert p.held_back(H100_T) == 85031714816 - 74381059686 == 10650655130
    assert p.error(H100_T) is None
    assert BudgetPolicy(0.0, 0, "t").error(H100_T) is None  # both ends of [0, 1] are allowed
    assert BudgetPolicy(1.0, H100_T, "t").error(H100_T) is None  # a reserve of the whole GPU too
    assert "outside [0, 1]" in (BudgetPolicy(1.0001, 0, "t").error() or "")
    assert "outside [0, 1]" in (BudgetPolicy(-0.0001, 0, "t").error() or "")
    assert "must not be negative" in (BudgetPolicy(0.9, -1, "t").error() or "")
    assert "larger than the GPU" in (BudgetPolicy(0.9, H100_T + 1, "t").error(H100_T) or "")
    # counted: ceil(0.9 T) + one CUDA context (0.55 GiB), what a lone vLLM at its default really uses
    assert BudgetPolicy().budget(H100_T) == 76528543335 + 590558003 == 77119101338
    assert BudgetPolicy().held_back(H100_T) == 85031714816 - 77119101338


@pytest.mark.parametrize(("minor", "u", "requested"), [
    (15, 0.2432, 20679713044),  # 0.15+: ceil(20679713043.2512)
    (11, 0.2432, 20679713043),  # before: the float product, int() here (the comparison is the same)
    (15, 0.5, 42515857408),  # an exact product: no rounding up
    (11, 0.5, 42515857408),
    (21, 1.0, H100_T),
])
def test_requested_bytes_is_vllms_request(minor: int, u: float, requested: int) -> None:
    assert requested_bytes(H100_T, u, VllmVersion(0, minor)) == requested


@pytest.mark.parametrize(("requested", "u"), [
    # T x u >= requested exactly, so every version's request (ceil, or the product before 0.15) is enough:
    (20679713044, 0.2433),  # T x 0.2432 = 20679713043.2512: ceil would do, the product would not
    (20679713043, 0.2432),
    (20671209872, 0.2432),  # T x 0.2431 = 20671209871.7696
    (20671209871, 0.2431),
    (42515857408, 0.5),  # T x 0.5 exactly
    (42515857409, 0.5001),
    (H100_T, 1.0),
    (H100_T + 1, 1.0),  # capped: no u asks for more than the GPU
    (1, 0.0001),
])
def test_utilization_for_is_the_smallest_u_whose_request_is_enough_in_every_version(requested: int, u: float) -> None:
    from fractions import Fraction

    assert utilization_for(H100_T, requested) == u
    if requested <= H100_T:
        assert H100_T * Fraction(str(u)) >= requested
        assert H100_T * (Fraction(str(u)) - Fraction(1, 10**4)) < requested


# --- sliding-window blocks per request ------------------------------------------------------------


def _vllm_sliding_blocks(window: int, in_flight: int, max_model_len: int, block_size: int) -> int:
    """SlidingWindowSpec.max_memory_usage_bytes / page_size_bytes."""
    num_tokens = min(window - 1 + in_flight, max_model_len)
    return -(-num_tokens // block_size) + 1


def _layout(version: VllmVersion, full: int = 0, sliding: int = 1, window: int = 4096) -> KvLayout:
    return KvLayout(block_size=16, block_bytes=1 << 20, full_groups=full, sliding_groups=sliding, window=window,
                    version=version)


PRE_33 = [VllmVersion(0, m) for m in (11, 15, 17, 19, 21)]


@pytest.mark.parametrize("version", PRE_33, ids=lambda v: v.label)
@pytest.mark.parametrize(
    ("batched", "length", "blocks"),
    [
        # W - 1 + B = 4095 + 2049 = 6144 = 384 x 16: 384 blocks + 1 (the window may start mid-block)
        (2049, 131072, 385),
        # 4095 + 2050 = 6145: ceil(6145 / 16) = 385, + 1 = 386
        (2050, 131072, 386),
        # 4095 + 2048 = 6143: ceil = 384, + 1 = 385
        (2048, 131072, 385),
        # 4095 + 1 = 4096 = 256 x 16: 257
        (1, 131072, 257),
        # max_model_len below the window: ceil(4000 / 16) + 1 = 250 + 1 = 251
        (2048, 4000, 251),
        # max_model_len 6144 = W - 1 + 2049 exactly: 384 + 1
        (2049, 6144, 385),
        # max_model_len 6143 < 6144: ceil(6143 / 16) + 1 = 384 + 1
        (2049, 6143, 385),
        # max_model_len 6145 > 6144 = W - 1 + B: the window bounds it, 384 + 1
        (2049, 6145, 385),
    ],
)
def test_sliding_window_blocks_per_request_match_vllm(version: VllmVersion, batched: int, length: int,
                                                      blocks: int) -> None:
    assert _vllm_sliding_blocks(4096, batched, length, 16) == blocks
    assert _layout(version).blocks_per_request(length, batched) == blocks


@pytest.mark.parametrize(("pp", "batched", "blocks"), [
    # F = (PP + 1) x B. PP 1, B 1025: 4095 + 2050 = 6145 -> ceil 385 + 1 = 386
    (1, 1025, 386),
    # PP 1, B 1024: 4095 + 2048 = 6143 -> 384 + 1 = 385
    (1, 1024, 385),
    # PP 2, B 683: 4095 + 2049 = 6144 -> 384 + 1 = 385
    (2, 683, 385),
    # PP 2, B 684: 4095 + 2052 = 6147 -> 385 + 1 = 386
    (2, 684, 386),
])
def test_sliding_window_blocks_per_request_in_0_33_count_the_pipeline_in_flight(pp: int, batched: int,
                                                                                blocks: int) -> None:
    assert _vllm_sliding_blocks(4096, (pp + 1) * batched, 131072, 16) == blocks
    assert _layout(VllmVersion(0, 33)).blocks_per_request(131072, batched, pp) == blocks


def test_a_hybrid_request_holds_full_and_sliding_blocks_and_its_bytes_add_the_null_block() -> None:
    # 1 full group + 5 sliding groups (Gemma 3 style 5:1), W = 1024, bs 16, B = 2048, L = 32768:
    #   full: ceil(32768 / 16) = 2048; sliding: ceil(min(1023 + 2048, 32768) / 16) + 1 = 192 + 1 = 193
    #   per request = 2048 + 5 x 193 = 3013 blocks; 7 requests + the null block = 21092 blocks
    layout = _layout(VllmVersion(0, 21), full=1, sliding=5, window=1024)
    assert layout.blocks_per_request(32768, 2048) == 2048 + 5 * 193 == 3013
    assert layout.bytes_for(32768, 7, 2048) == (7 * 3013 + 1) * (1 << 20)


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(1, 1 << 17),
    batched=st.integers(1, 1 << 16),
    length=st.integers(1, 1 << 20),
    block_size=st.sampled_from([1, 16, 32, 64, 128, 256, 528]),
    minor=st.sampled_from([11, 15, 17, 19, 21]),
)
def test_sliding_window_blocks_per_request_equal_vllms_formula(window: int, batched: int, length: int,
                                                               block_size: int, minor: int) -> None:
    layout = KvLayout(block_size, 4096, 0, 1, window, VllmVersion(0, minor))
    assert layout.blocks_per_request(length, batched) == _vllm_sliding_blocks(window, batched, length, block_size)


# --- KV sizing on a full-attention layout, by hand -------------------------------------------------
# block size 16 tokens, one block of every layer slot = 1 MiB, one full-attention group:
# a request of 1000 tokens holds ceil(1000 / 16) = 63 blocks; the pool keeps one null block.
MIB = 1 << 20


def _full(minor: int = 21) -> KvLayout:
    return KvLayout(block_size=16, block_bytes=MIB, full_groups=1, sliding_groups=0, window=None,
                    version=VllmVersion(0, minor))


def test_full_attention_blocks_and_bytes() -> None:
    kv = _full()
    assert kv.blocks_per_request(1000, 2048) == 63
    assert kv.blocks_per_request(1008, 2048) == 63 and kv.blocks_per_request(1009, 2048) == 64
    assert kv.bytes_for(1000, 7, 2048) == (7 * 63 + 1) * MIB == 442 * MIB
    assert kv.bytes_for_tokens(1000) == (63 + 1) * MIB
    assert kv.bytes_per_token == MIB // 16 == 65536


def test_num_blocks_pool_tokens_and_concurrency() -> None:
    kv = _full()
    assert kv.num_blocks(100 * MIB + 5) == 100
    assert kv.num_blocks(100 * MIB - 1) == 99
    assert kv.num_blocks(-MIB) == 0
    assert KvLayout(16, 0, 1, 0, None, VllmVersion(0, 21)).num_blocks(MIB) == 0
    assert kv.pool_tokens(100 * MIB) == (100 - 1) * 16 == 1584  # the null block is not the tenant's
    assert kv.pool_tokens(MIB) == 0
    assert kv.concurrency(100 * MIB, 1000, 2048) == pytest.approx(99 / 63)
    assert kv.concurrency(MIB, 1000, 2048) == 0.0


@pytest.mark.parametrize(("kv_bytes", "limit", "length"), [
    (442 * MIB, 131072, 1008),  # 7 x 63 + 1 = 442 blocks: 63 blocks each = 1008 tokens
    (442 * MIB - 1, 131072, 992),  # one byte less: 7 x 62 + 1 = 435 blocks fit, 63 do not
    (442 * MIB, 1000, 992),  # the limit, rounded down to the block size (62 x 16)
    (8 * MIB, 131072, 16),  # 7 x 1 + 1 = 8 blocks: one block each
    (8 * MIB - 1, 131072, 0),  # not even that
])
def test_max_length_is_the_longest_context_that_fits(kv_bytes: int, limit: int, length: int) -> None:
    kv = _full()
    assert kv.max_length(kv_bytes, 7, 2048, limit) == length
    if length:
        assert kv.bytes_for(length, 7, 2048) <= kv_bytes
    if length + 16 <= limit:
        assert kv.bytes_for(length + 16, 7, 2048) > kv_bytes


@pytest.mark.parametrize(("kv_bytes", "seqs"), [
    (442 * MIB, 7),  # (442 - 1) // 63 = 7
    (442 * MIB - 1, 6),
    (64 * MIB, 1),
    (64 * MIB - 1, 0),
    (0, 0),
])
def test_max_seqs_is_the_most_requests_that_fit(kv_bytes: int, seqs: int) -> None:
    kv = _full()
    assert kv.max_seqs(kv_bytes, 1000, 2048) == seqs
    if seqs:
        assert kv.bytes_for(1000, seqs, 2048) <= kv_bytes < kv.bytes_for(1000, seqs + 1, 2048)


@pytest.mark.parametrize("minor", [11, 15, 17, 19])
def test_logged_tokens_before_0_21_are_blocks_times_block_size(minor: int) -> None:
    # 100 blocks, one group: 100 x 16 = 1600 tokens; concurrency 100 / 63 requests of 1000 tokens
    tokens, concurrency = _full(minor).tokens(100 * MIB, 1000, 2048)
    assert tokens == 1600
    assert concurrency == pytest.approx(100 / 63)


def test_logged_tokens_from_0_21_are_concurrency_times_length() -> None:
    tokens, concurrency = _full(21).tokens(100 * MIB, 1000, 2048)
    assert concurrency == pytest.approx(100 / 63)
    assert tokens == int(100 / 63 * 1000) == 1587
    assert _full(21).tokens(MIB // 2, 1000, 2048) == (0, 0.0)


# --- the KV cache's element size, and the 0.33 pipeline term through every caller -------------------


def test_kv_dtype_bytes_follow_the_flag_then_the_checkpoint_then_the_model() -> None:
    import dataclasses

    from vllmfit.core.memory import Settings
    from vllmfit.core.memory.kv import kv_dtype_bytes
    from vllmfit.core.model.facts import Quant
    from vllmfit.sources import catalog

    llama = catalog.model("meta-llama/Llama-3.1-8B-Instruct")  # bfloat16
    kv_fp8 = dataclasses.replace(llama, quant=Quant("fp8", 8, kv_fp8=True))
    assert kv_dtype_bytes(llama, Settings()) == 2
    for flag in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert kv_dtype_bytes(llama, Settings(kv_cache_dtype=flag)) == 1
    assert kv_dtype_bytes(kv_fp8, Settings()) == 1  # "auto" takes the checkpoint's fp8 KV scheme
    assert kv_dtype_bytes(kv_fp8, Settings(kv_cache_dtype="bfloat16")) == 2  # an explicit flag wins
    assert kv_dtype_bytes(llama, Settings(kv_cache_dtype="float32")) == 4


def test_0_33_counts_one_pipeline_stage_by_default_and_in_concurrency_tokens_and_max_length() -> None:
    # W 4096, bs 16, 1 MiB blocks, one sliding group; F = (PP + 1) x B.
    kv = _layout(VllmVersion(0, 33))
    assert kv.blocks_per_request(131072, 1025) == 386  # PP 1 by default: 4095 + 2050 -> 385 + 1
    # PP 2, B 683: 4095 + 2049 = 6144 -> 385 blocks; PP 1 would give 4095 + 1366 = 5461 -> 342 + 1 = 343
    assert kv.blocks_per_request(131072, 683, 2) == 385
    assert kv.concurrency(386 * MIB, 131072, 683, 2) == pytest.approx(385 / 385)
    assert kv.max_seqs(2 * 385 * MIB + MIB, 131072, 683, 2) == 2


def test_a_sliding_layout_passes_the_batch_through_tokens_and_max_length() -> None:
    kv = _layout(VllmVersion(0, 21))  # W 4096, bs 16
    # B 2049: ceil(min(6144, L) / 16) + 1 blocks per request; 1001 blocks, 0.21: int(1001 / 385 x L)
    tokens, concurrency = kv.tokens(1001 * MIB, 131072, 2049)
    assert concurrency == pytest.approx(1001 / 385)
    assert tokens == int(1001 / 385 * 131072)
    # 2 requests and the null block in 771 blocks: 385 each; a longer context needs no more
    assert kv.max_length(771 * MIB, 2, 2049, 131072) == 131072
    assert kv.max_length(771 * MIB - 1, 2, 2049, 131072) == (384 - 1) * 16  # 384 blocks each: 6128 tokens


def test_a_layout_without_groups_holds_nothing() -> None:
    kv = KvLayout(16, MIB, 0, 0, None, VllmVersion(0, 21))
    assert kv.blocks_per_request(1000, 2048) == 0
    assert kv.concurrency(100 * MIB, 1000, 2048) == 0.0
    assert kv.pool_tokens(100 * MIB) == 0
    assert kv.max_seqs(100 * MIB, 1000, 2048) == 0


def test_0_33_max_length_counts_the_pipeline_term() -> None:
    # PP 2, B 683: 385 blocks per request at any length past the window (see above); PP 1 would be 343.
    kv = _layout(VllmVersion(0, 33))
    assert kv.max_length(2 * 385 * MIB + MIB, 2, 683, 131072, 2) == 131072
    assert kv.max_length(2 * 385 * MIB + MIB - 1, 2, 683, 131072, 2) < 131072


def test_a_pooling_model_without_layer_types_holds_no_kv_cache() -> None:
    import dataclasses

    from vllmfit.core.memory import Settings
    from vllmfit.core.memory.kv import kv_layout
    from vllmfit.sources import catalog

    bge = dataclasses.replace(catalog.model("BAAI/bge-m3"), layer_types=())
    assert bge.pooling
    kv = kv_layout(bge, Settings(), VllmVersion(0, 21))
    assert (kv.block_bytes, kv.groups, kv.pooling, kv.version) == (0, 0, True, VllmVersion(0, 21))
    assert kv.bytes_for(8192, 4, 2048) == 0
    assert kv.blocks_per_request(8192, 2048) == 0


def test_max_seqs_and_tokens_in_0_33_pass_the_batch_and_the_pipeline() -> None:
    kv = _layout(VllmVersion(0, 33))  # W 4096, bs 16, one sliding group, 1 MiB blocks
    # PP 1 by default, B 1025: 386 blocks per request; 2 requests and the null block: 773 blocks
    assert kv.max_seqs(773 * MIB, 131072, 1025) == 2
    # PP 2, B 683: 385 blocks per request; one byte short of 771 blocks: 1 request
    assert kv.max_seqs(771 * MIB - 1, 131072, 683, 2) == 1
    # the logged concurrency divides every block (0.33 get_max_concurrency_for_kv_cache_config)
    assert kv.tokens(386 * MIB, 131072, 683, 2)[1] == pytest.approx(386 / 385)


def test_a_hybrid_pool_of_tokens_counts_every_group() -> None:
    # 1 full + 5 sliding groups, 1000 tokens each: 6 x ceil(1000 / 16) = 378 blocks, one more block
    # in each window-bounded group (vLLM SlidingWindowSpec.max_memory_usage_bytes: cdiv + 1) and
    # the null block
    kv = KvLayout(16, MIB, 1, 5, 1024, VllmVersion(0, 21))
    assert kv.bytes_for_tokens(1000) == (6 * 63 + 5 + 1) * MIB
    assert kv.pool_tokens((6 * 63 + 5 + 1) * MIB) == 63 * 16  # the inverse: whole blocks in every group
    assert kv.pool_tokens((6 * 63 + 5) * MIB) == 62 * 16


def test_a_pool_of_max_model_len_tokens_holds_one_request_of_it() -> None:
    # Gemma 2 (sliding W 4096 over a 1024 context): one request needs ceil(1024 / 16) + 1 blocks in
    # the window-bounded group (vLLM's start-up check), so 1024 tokens are 64 + 65 blocks + null
    kv = KvLayout(16, MIB, 1, 1, 4096, VllmVersion(0, 21))
    assert kv.bytes_for(1024, 1, 2048) == (64 + 65 + 1) * MIB
    assert kv.bytes_for_tokens(1024) == kv.bytes_for(1024, 1, 2048)
    assert kv.pool_tokens(kv.bytes_for(1024, 1, 2048)) == 1024


def test_sliding_window_models_get_one_window_bounded_group_per_kind() -> None:
    """By hand from config.json: Mistral-7B v0.1, 32 layers all sliding (W 4096), 8 KV heads x 128,
    bf16: 2 x 8 x 128 x 2 B x 16 tokens x 32 layers = 2097152 bytes a block, one sliding group.
    Gemma 3 12B, 48 layers (40 sliding W 1024, 8 full), 8 KV heads x 256: groups of 8 layers,
    1 full + 5 sliding, a block of 2 x 8 x 256 x 2 x 16 x 8 = 1048576 bytes."""
    from vllmfit.core.memory import Settings
    from vllmfit.core.memory.kv import kv_layout
    from vllmfit.sources import catalog

    v = VllmVersion(0, 21)
    mistral = kv_layout(catalog.model("mistralai/Mistral-7B-Instruct-v0.1"), Settings(), v)
    assert (mistral.full_groups, mistral.sliding_groups, mistral.window, mistral.block_bytes) == (0, 1, 4096, 2097152)
    gemma = kv_layout(catalog.model("google/gemma-3-12b-it"), Settings(), v)
    assert (gemma.full_groups, gemma.sliding_groups, gemma.window, gemma.block_bytes) == (1, 5, 1024, 1048576)
