"""Colocated vLLM processes start in any order: vLLM's start-up check, simulated for every permutation.

vLLM (vllm-memory-accounting.md §3): a starting process measures free0 after its own CUDA context is
resident and refuses to start unless free0 >= R = ceil(T x u). Processes already running hold their
context plus R (plus the CUDA-graph pool before 0.21, captured outside R).
"""

from __future__ import annotations

import itertools

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

from vllmfit.core import placement


def _procs(
    p: placement.Plan, node_name: str, index: int, graphs_outside: bool
) -> list[tuple[int, float, int]]:
    out = []
    for b in p.ledger.bookings_on(node_name, index):
        d = p.decisions[b.deployment]
        r = next(r for r in d.replicas if r.replica == b.replica)
        fp = r.sizing.footprint
        out.append(
            (fp.cuda_context, r.sizing.flags.gpu_memory_utilization, fp.cuda_graphs if graphs_outside else 0)
        )
    return out


@pytest.mark.parametrize(
    "image,graphs_outside",
    [
        ("vllm/vllm-openai:v0.33.0", False),
        ("vllm/vllm-openai:v0.21.0", False),
        ("vllm/vllm-openai:v0.15.0", True),
    ],
)
@pytest.mark.parametrize("foreign", [0, 6 << 30])
def test_four_colocated_deployments_start_in_every_order(
    image: str, graphs_outside: bool, foreign: int
) -> None:
    reqs = [
        request("llama", LLAMA_8B, "1", maxModelLen=8192, maxNumSeqs=4, image=image),
        request("qwen7", QWEN_7B, "2", maxModelLen=8192, maxNumSeqs=8, image=image),
        request("qwen05", QWEN_05B, "3", maxModelLen=4096, maxNumSeqs=16, image=image),
        request("qwen05b", QWEN_05B, "4", maxModelLen=2048, maxNumSeqs=4, image=image),
    ]
    p = placement.plan([node("n", H100, 1, foreign={0: foreign})], reqs)
    assert all(d.admitted for d in p.decisions.values()), {k: d.message for k, d in p.decisions.items()}
    check_invariant(p.ledger)
    procs = _procs(p, "n", 0, graphs_outside)
    assert len(procs) == 4
    ceil_r = image != "vllm/vllm-openai:v0.11.0"
    for order in itertools.permutations(range(4)):
        assert start_order_ok(H100.cuda_total_bytes, foreign, procs, order, ceil_r), order


def test_a_full_gpu_fails_the_start_check_in_some_order() -> None:
    """The check is not vacuous: u values that add up past T fail for the last process."""
    T = H100.cuda_total_bytes
    ctx = 590558003
    procs = [(ctx, 0.5, 0), (ctx, 0.5, 0)]  # the vLLM docstring's 2 x 0.5, with contexts
    assert not start_order_ok(T, 0, procs, (0, 1))


def test_an_unset_context_takes_only_the_room_left() -> None:
    """maxModelLen unset: the context shrinks to the headroom left; earlier bookings are untouched."""
    ledger = placement.Ledger([node("n", H100, 1)])
    ledger.book(placement.decide(ledger, request("a", LLAMA_8B, "1", maxModelLen=8192, maxNumSeqs=8)))
    a_before = ledger.bookings_of("default/a")
    room = ledger.headroom_bytes("n", 0)
    d = placement.decide(ledger, request("b", LLAMA_8B, "2", maxNumSeqs=4))
    assert d.admitted
    assert d.replicas[0].sizing.footprint.total <= room
    assert 2048 <= d.flags.max_model_len < LLAMA_8B.max_model_len  # 131072 x 4 x 128 KiB would be 64 GiB
    assert any("context reduced" in w for w in d.warnings)
    ledger.book(d)
    assert ledger.bookings_of("default/a") == a_before
    check_invariant(ledger)


def test_a_mixed_capacity_group_books_each_gpus_own_request() -> None:
    """Pinned TP=2 over an H100 and an A100-40GB: one u, so the H100 rank requests
    ceil(T_h100 x u), more than the A100 rank; each GPU books its own, and a warning says so."""
    mixed = placement.NodeInfo("m", {}, (placement.GpuSlot("m", 0, H100), placement.GpuSlot("m", 1, A100_40)))
    r = request(
        "tp2",
        LLAMA_8B,
        tensorParallelSize=2,
        maxModelLen=4096,
        maxNumSeqs=4,
        placement={"nodeName": "m", "gpuIndices": [0, 1]},
    )
    p = placement.plan([mixed], [r])
    d = p.decisions["default/tp2"]
    assert d.admitted
    assert any("mix capacities" in w for w in d.warnings)
    u = d.flags.gpu_memory_utilization
    import math

    fp_h100, fp_a100 = d.replicas[0].footprints
    ctx = fp_h100.cuda_context
    assert fp_h100.total == ctx + math.ceil(H100.cuda_total_bytes * u)
    assert fp_a100.total == ctx + math.ceil(A100_40.cuda_total_bytes * u)
    check_invariant(p.ledger)
