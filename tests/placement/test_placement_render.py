"""render: bars add up, every GPU bar covers exactly its capacity, estimate pictures say the verdict."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from placement_fakes import H100, L4, LLAMA_8B, QWEN_05B, node, request
from rich.console import Console

from vllmfit.cli import render
from vllmfit.cli.render import layout
from vllmfit.core import memory, placement


@given(st.lists(st.integers(0, 10**12), min_size=1, max_size=12), st.integers(1, 200))
def test_cells_add_up_to_the_width(values: list[int], width: int) -> None:
    out = layout.cells(values, width)
    assert sum(out) == (width if sum(values) else 0)
    assert all(abs(c - v * width / sum(values)) < 1 for c, v in zip(out, values)) if sum(values) else True


def test_a_gpu_bar_is_its_capacity_split_into_bookings_foreign_free_and_reserve() -> None:
    p = placement.plan(
        [node("n", H100, 1, foreign={0: 5 << 30})],
        [
            request("a", LLAMA_8B, "1", maxModelLen=8192, kvCache={"concurrency": 4}),
            request("b", QWEN_05B, "2", maxModelLen=4096, kvCache={"concurrency": 4}),
        ],
    )
    sl = p.ledger.slots()[0]
    segs = layout.gpu_segments(p, sl, layout.looks(p))
    assert sum(s.bytes for s in segs) == H100.cuda_total_bytes
    by = {s.label: s.bytes for s in segs}
    assert by["foreign use"] == 5 << 30
    assert by["reserve"] == H100.cuda_total_bytes - sl.budget_bytes
    assert by["free"] == p.ledger.headroom_bytes("n", 0)
    fp = p.decisions["default/a"].replicas[0].sizing.footprint
    assert by["default/a weights"] == fp.weights and by["default/a KV cache"] == fp.kv_cache
    assert by["default/a activation + overhead"] == fp.activation + fp.overhead


def _text(fn, *args) -> str:  # type: ignore[no-untyped-def]
    console = Console(width=100, record=True, color_system=None)
    fn(console, *args)
    return console.export_text()


def test_print_estimate_fits() -> None:
    est = memory.estimate(LLAMA_8B, memory.Settings(max_model_len=8192, kv_concurrency=8), H100)
    out = _text(render.print_estimate, est)
    assert "fits: " in out and "--max-model-len=8192" in out and "vLLM start-up (predicted log)" in out
    assert f"{layout.gib(est.sizing.footprint.total)} of {layout.gib(H100.cuda_total_bytes)} GiB" in out


def test_print_estimate_does_not_fit() -> None:
    est = memory.estimate(LLAMA_8B, memory.Settings(max_model_len=131072, kv_concurrency=8), L4)
    out = _text(render.print_estimate, est)
    assert "does not fit" in out and "over budget by" in out and "flags (if it fit)" in out
    assert "vLLM start-up" not in out


def test_print_plan_names_every_node_and_deployment() -> None:
    p = placement.plan(
        [node("gpu-a", H100, 2), node("gpu-b", L4, 1)],
        [
            request("a", LLAMA_8B, "1", maxModelLen=8192, kvCache={"concurrency": 4}),
            request("huge", LLAMA_8B, "2", maxModelLen=131072, kvCache={"concurrency": 64}),
        ],
    )
    out = _text(render.print_plan, p)
    assert "gpu-a: 2x H100-80GB-HBM3" in out and "gpu-b: 1x L4" in out
    assert "Admitted      A default/a" in out and "Unschedulable - default/huge" in out  # letter; no bar: "-"
    # the refusal in the terminal: the kube-scheduler's headline, then one line per group
    assert "  0/2 nodes are available:\n  - 1 GPU memory (NVIDIA-H100-80GB-HBM3: needs " in out
    assert "--max-model-len=8192 --max-num-seqs=1024" in out
