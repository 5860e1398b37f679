"""Colocated vLLM processes start in any order: vLLM's start-up check, simulated for every permutation,
under each budget policy and memory policy, on four vLLM versions.

vLLM (vllm-memory-accounting.md §3, vllm-flags.md §4): a starting process measures free0 after its own
CUDA context is resident and refuses to start unless free0 >= R = ceil(T x u) (T x u before 0.15), also
when --kv-cache-memory-bytes is set. What a running process then holds:
- u only: its context + R (+ the CUDA-graph pool before 0.21, captured outside R);
- --kv-cache-memory-bytes N: its context + weights + activation + non-torch + graphs + N, whatever u is.

Three flag combinations are checked against the memory model; vllmfit injects the one that is safe in
every start order and pins the KV cache to the request: N with the matching u.
"""

from __future__ import annotations

import itertools
import math

import pytest
from placement_fakes import (
    A100_40,
    H100,
    LLAMA_8B,
    QWEN_05B,
    QWEN_7B,
    check_invariant,
    node,
    request,
    start_order_ok,
)

from vllmfit.core import memory, placement
from vllmfit.core.defaults import GIB

VERSIONS = {"0.11": "vllm/vllm-openai:v0.11.0", "0.15": "vllm/vllm-openai:v0.15.0",
            "0.21": "vllm/vllm-openai:v0.21.0", "0.33": "vllm/vllm-openai:v0.33.0"}
POLICIES = {
    "adr-default": memory.BudgetPolicy(),
    "tight": memory.BudgetPolicy(0.88, 3 * GIB, "cluster"),
    "loose": memory.BudgetPolicy(0.97, GIB // 2, "node pool label"),
}


def _procs(p: placement.Plan, version: memory.VllmVersion, combo: str) -> list[tuple[int, float, int]]:
    """(context, u, held beyond context + R once running) of every process on n GPU 0, for one flag
    combination: 'ours' (what vllmfit injects), 'u-only', or 'kv+default-u' (vLLM's default u)."""
    T = H100.cuda_total_bytes
    out = []
    for b in p.ledger.bookings_on("n", 0):
        r = next(r for r in p.decisions[b.deployment].replicas if r.replica == b.replica)
        fp, f = r.sizing.footprint, r.sizing.flags
        outside = 0 if version.graphs_in_budget else fp.cuda_graphs
        kv = f.kv_cache_memory_bytes
        if combo == "u-only":
            kv = None
        u = version.default_utilization if combo == "kv+default-u" else f.gpu_memory_utilization
        if combo == "kv+default-u" and kv is None:
            kv = fp.kv_cache
        R = memory.requested_bytes(T, u, version)
        if kv is None:  # vLLM fills R: KV = R - the rest
            held_beyond = outside
        else:  # vLLM holds exactly N of KV plus what it measured, whatever R is
            inside = fp.weights + fp.activation + fp.non_torch + (fp.cuda_graphs if version.graphs_in_budget else 0)
            held_beyond = inside + kv - R + outside
        out.append((fp.cuda_context, u, held_beyond))
    return out


def _plan(image: str, policy: memory.BudgetPolicy, mem: memory.Policy, foreign: int) -> placement.Plan:
    reqs = [
        request("llama", LLAMA_8B, "1", maxModelLen=8192, kvCache={"concurrency": 4}, image=image),
        request("qwen7", QWEN_7B, "2", maxModelLen=8192, kvCache={"tokens": 40000}, image=image),
        request("qwen05", QWEN_05B, "3", maxModelLen=4096, kvCache={"memory": "1Gi"}, image=image),
        request("qwen05b", QWEN_05B, "4", maxModelLen=2048, kvCache={"concurrency": 16, "typicalLength": 512},
                image=image),
    ]
    if mem == "adr":  # ADR-0002's formulas take maxNumSeqs x maxModelLen
        reqs = [request(r.key.split("/")[1], r.model, r.order[0], maxModelLen=r.spec.max_model_len, maxNumSeqs=4,
                        image=image) for r in reqs]
    return placement.plan([node("n", H100, 1, foreign={0: foreign}, policy=policy)], reqs, policy=mem)


@pytest.mark.parametrize("label", sorted(VERSIONS))
@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("mem", ["vllm", "adr"])
@pytest.mark.parametrize("foreign", [0, 3 << 30])
def test_colocated_servers_start_in_every_order(label: str, policy_name: str, mem: memory.Policy,
                                                 foreign: int) -> None:
    version, _ = memory.parse_version(label)
    policy = POLICIES[policy_name]
    p = _plan(VERSIONS[label], policy, mem, foreign)
    assert all(d.admitted for d in p.decisions.values()), {k: d.message for k, d in p.decisions.items()}
    check_invariant(p.ledger)
    T = H100.cuda_total_bytes
    used = p.ledger.used_bytes("n", 0)
    assert used <= policy.budget(T)
    ceil_r = version.ceil_requested
    for combo in ("ours", "u-only"):
        procs = _procs(p, version, combo)
        assert len(procs) == 4
        for order in itertools.permutations(range(4)):
            assert start_order_ok(T, foreign, procs, order, ceil_r), (combo, order)
        # and once all run, they hold no more than the ledger booked (+ foreign): never past T
        held = foreign + sum(ctx + memory.requested_bytes(T, u, version) + extra for ctx, u, extra in procs)
        assert held <= used <= T
    flags = [d.flags for d in p.decisions.values()]
    if mem == "vllm":  # every modelled version has --kv-cache-memory-bytes (>= 0.10.2): injected
        assert all(f.kv_cache_memory_bytes for f in flags)
        assert all(f"--kv-cache-memory-bytes={f.kv_cache_memory_bytes}" in f.args() for f in flags)
        # --kv-cache-memory-bytes with vLLM's default u: the second server to start finds less
        # than 0.9 (0.92) x T free and refuses, in every order
        bad = _procs(p, version, "kv+default-u")
        assert not any(start_order_ok(T, foreign, bad, order, ceil_r) for order in itertools.permutations(range(4)))
    else:  # adr: u only (the ADR footprint has no runtime overheads to pin a KV size against)
        assert not any(f.kv_cache_memory_bytes for f in flags)


def test_a_full_gpu_fails_the_start_check_in_some_order() -> None:
    """The check is not vacuous: u values that add up past T fail for the last process."""
    T = H100.cuda_total_bytes
    ctx = 590558003
    procs = [(ctx, 0.5, 0), (ctx, 0.5, 0)]  # the vLLM docstring's 2 x 0.5, with contexts
    assert not start_order_ok(T, 0, procs, (0, 1))


def test_an_image_older_than_0_10_2_gets_no_kv_cache_memory_bytes() -> None:
    """--kv-cache-memory-bytes first shipped in 0.10.2 (vllm-flags.md §4): older images get u only."""
    for image, has in (("vllm/vllm-openai:v0.10.1", False), ("vllm/vllm-openai:v0.10.2", True),
                       ("vllm/vllm-openai:v0.10.0", False), ("vllm/vllm-openai:v0.11.0", True)):
        d = placement.decide(placement.Ledger([node("n", H100, 1)]), request("a", QWEN_05B, maxModelLen=4096,
                                                                              image=image))
        assert d.admitted
        assert (d.flags.kv_cache_memory_bytes is not None) is has, image


def test_an_unset_context_takes_only_the_room_left() -> None:
    """maxModelLen unset: the context shrinks to the headroom left; earlier bookings are untouched."""
    ledger = placement.Ledger([node("n", H100, 1)])
    ledger.book(placement.decide(ledger, request("a", LLAMA_8B, "1", maxModelLen=8192, kvCache={"concurrency": 8})))
    a_before = ledger.bookings_of("default/a")
    room = ledger.headroom_bytes("n", 0)
    d = placement.decide(ledger, request("b", LLAMA_8B, "2", kvCache={"concurrency": 4}))
    assert d.admitted
    assert d.replicas[0].sizing.footprint.total <= room
    assert 2048 <= d.flags.max_model_len < LLAMA_8B.max_model_len  # 131072 x 4 x 128 KiB would be 64 GiB
    assert any("context reduced" in w for w in d.warnings)
    ledger.book(d)
    assert ledger.bookings_of("default/a") == a_before
    check_invariant(ledger)


def test_a_growing_kv_cache_takes_the_room_left_and_no_more() -> None:
    """kvCache.grow: the KV cache grows into the GPU's headroom (block multiples); the ledger stays
    within budget and a later deployment is refused rather than squeezed."""
    ledger = placement.Ledger([node("n", H100, 1)])
    ledger.book(placement.decide(ledger, request("a", QWEN_05B, "1", maxModelLen=4096, kvCache={"concurrency": 1})))
    d = placement.decide(ledger, request("g", LLAMA_8B, "2", maxModelLen=8192, kvCache={"tokens": 8192,
                                                                                          "grow": True}))
    assert d.admitted
    sz = d.replicas[0].sizing
    assert sz.granted_tokens > 8192 * 10  # tens of GiB at 128 KiB per token
    ledger.book(d)
    check_invariant(ledger)
    block = 16 * 131072  # 16 tokens x 128 KiB (Llama-3.1-8B, bf16, TP 1)
    assert 0 <= ledger.headroom_bytes("n", 0) < block + math.ceil(H100.cuda_total_bytes / 10_000)
    assert not placement.decide(ledger, request("late", QWEN_05B, "3", maxModelLen=4096)).admitted


def test_no_kv_request_gets_at_most_its_caps_clamped_to_the_room_and_at_least_one_full_request() -> None:
    """With no spec.kvCache the KV cache is at least its request (2 full-length requests, at most
    maxNumSeqs) and at most its limit, maxNumSeqs x maxModelLen (vLLM's default maxNumSeqs when
    unset); between them a fair share (1/8 of the budget for the whole footprint: below an 8B's
    weights, so the request; with 1 tenant per GPU, the whole budget) or, `room`, the room left as
    `grow` gives it, clamped to the room left in whole blocks; a spec that asks for tokens gets
    exactly those."""
    block = 16 * 131072  # 16 tokens x 128 KiB (Llama-3.1-8B, bf16, TP 1)
    ledger = placement.Ledger([node("n", H100, 1)])
    capped = placement.decide(ledger, request("c", LLAMA_8B, "1", maxModelLen=8192, maxNumSeqs=3))
    z = capped.replicas[0].sizing  # the request: 2 x 512 blocks + the null block, by hand
    assert z.footprint.kv_cache == (2 * 512 + 1) * block and z.granted_tokens == 2 * 8192
    shared = placement.decide(ledger, request("u", LLAMA_8B, "1", maxModelLen=8192)).replicas[0].sizing
    assert shared.footprint.kv_cache == (2 * 512 + 1) * block and shared.granted_tokens == 2 * 8192
    alone = placement.Ledger([node("n", H100, 1)], kv_grant=memory.KvGrant(tenants=1))
    z = placement.decide(alone, request("c", LLAMA_8B, "1", maxModelLen=8192, maxNumSeqs=3)).replicas[0].sizing
    assert z.footprint.kv_cache == (3 * 512 + 1) * block and z.granted_tokens == 3 * 8192  # the limit
    ledger = placement.Ledger([node("n", H100, 1)], kv_grant=memory.KvGrant("room"))
    unasked = placement.decide(ledger, request("u", LLAMA_8B, "1", maxModelLen=8192))
    grow = placement.decide(ledger, request("g", LLAMA_8B, "1", maxModelLen=8192, kvCache={"grow": True}))
    assert unasked.admitted and grow.admitted
    z = unasked.replicas[0].sizing
    assert z.footprint == grow.replicas[0].sizing.footprint and z.granted_tokens == grow.replicas[0].sizing.granted_tokens
    block = 16 * 131072  # 16 tokens x 128 KiB (Llama-3.1-8B, bf16, TP 1)
    budget = math.ceil(0.9 * H100.cuda_total_bytes) + int(0.55 * (1 << 30))  # counted: an empty H100
    assert 0 <= budget - z.footprint.total < block + math.ceil(H100.cuda_total_bytes / 10_000)
    # whole blocks; vLLM 0.33 holds one (the null block) back from the tokens it grants
    assert z.footprint.kv_cache % block == 0 and z.granted_tokens == z.footprint.kv_cache // 131072 - 16
    assert z.granted_tokens <= 1024 * 8192  # vLLM's default maxNumSeqs on an H100 x maxModelLen
    # a neighbour leaves room for one request of 8192 tokens and a bit: still admitted, at least one request
    ledger.book(placement.decide(ledger, request("big", LLAMA_8B, "0", maxModelLen=8192,
                                                 kvCache={"tokens": z.granted_tokens - 9000})))
    squeezed = placement.decide(ledger, request("late", LLAMA_8B, "2", maxModelLen=8192))
    if squeezed.admitted:
        assert squeezed.replicas[0].sizing.granted_tokens >= 8192
    # a spec asks for less
    ledger = placement.Ledger([node("n", H100, 1)])
    less = placement.decide(ledger, request("t", LLAMA_8B, "1", maxModelLen=8192, kvCache={"tokens": 16384}))
    assert less.replicas[0].sizing.granted_tokens == 16384


def test_a_mixed_capacity_group_books_each_gpus_own_request() -> None:
    """Pinned TP=2 over an H100 and an A100-40GB: one u, so the H100 rank requests
    ceil(T_h100 x u), more than the A100 rank; each GPU books its own, and a warning says so."""
    mixed = placement.NodeInfo("m", {}, (placement.GpuSlot("m", 0, H100), placement.GpuSlot("m", 1, A100_40)))
    r = request(
        "tp2",
        LLAMA_8B,
        tensorParallelSize=2,
        maxModelLen=4096,
        kvCache={"concurrency": 4},
        placement={"nodeName": "m", "gpuIndices": [0, 1]},
    )
    p = placement.plan([mixed], [r])
    d = p.decisions["default/tp2"]
    assert d.admitted
    assert any("mix capacities" in w for w in d.warnings)
    u = d.flags.gpu_memory_utilization
    fp_h100, fp_a100 = d.replicas[0].footprints
    ctx = fp_h100.cuda_context
    assert fp_h100.total == ctx + math.ceil(H100.cuda_total_bytes * u)
    assert fp_a100.total == ctx + math.ceil(A100_40.cuda_total_bytes * u)
    check_invariant(p.ledger)
