"""The KV prediction's error band per architecture class, measured on real vLLM start-up logs.

What vLLM finds as "Available KV cache memory" is R minus what it measures at start-up (weights,
activation peak, non-torch memory, CUDA graphs). vllmfit predicts those exactly where vLLM's code
makes them exact (weights, block rounding, groups) and from calibrated shape functions where vLLM
measures them at run time. The residual of the latter cannot be modelled away, so:

- `over` (bytes): the largest amount by which the prediction exceeded what vLLM logged, in the
  class, plus the logs' rounding (0.005 GiB), rounded up to 0.01 GiB. vllmfit books it inside R
  (Footprint.margin): the KV reservation it promises is a floor of what vLLM will find.
- `under` (bytes): the same for predictions below the log; with `over` it gives the range
  reported by `estimate` and in status (kvCacheRangeBytes).

Measured by `python benchmarks/accuracy.py --calibration ../shared/calibration` (it prints the
table these constants must equal; tests/test_calibration.py checks it): 52 logs, vLLM 0.10-0.19,
H100. A class without logs (recurrent-state hybrids) takes the largest measured band: a rule,
not a fitted value.
"""

from __future__ import annotations

from vllmfit.core.defaults import GIB
from vllmfit.core.memory.versions import VllmVersion
from vllmfit.core.model.facts import ModelArch

LOG_ROUNDING_GIB = 0.005
"""vLLM logs GiB with two decimals."""

KV_BAND_CENTI_GIB: dict[str, tuple[int, int]] = {
    # class: (over, under) in 0.01 GiB; max residual per class (pred - obs) over the calibration logs
    "dense": (23, 161),  # 43 logs: +0.215 (granite-3.1-8b), -1.599 (llama-3.3-70b fp8 TP2, NCCL non-torch)
    "moe": (2, 59),  # 4 logs: +0.007 (mixtral TP2), -0.581 (gpt-oss-20b mxfp4)
    "mla": (22, 64),  # 3 logs: +0.214 (kimi-vl-a3b), -0.634 (deepseek-v2-lite)
    "sliding": (14, 15),  # 2 logs: +0.128 (gemma-3-12b), -0.135 (gemma-2-9b)
}
GRAPH_BAND_CENTI_GIB: dict[str, tuple[int, int]] = {
    # From 0.21 vLLM subtracts its own CUDA-graph *estimate* from the KV budget ("Estimated CUDA graph
    # memory", v1/worker/gpu_model_runner.py); the logs give it. (over, under) in 0.01 GiB: the worst
    # (estimate - vllmfit's graph prediction), and the reverse, per class, + log rounding.
    "dense": (79, 35),  # 34 logs: estimate 0.776 above (llama-3.1-8b TP2: 1.69 vs 0.91), 0.344 below
    "moe": (1, 45),  # 3 logs: never above; 0.444 below
    "mla": (21, 16),  # 3 logs: 0.199 above, 0.151 below
    "sliding": (1, 23),  # 2 logs: never above; 0.219 below
}
UNMEASURED_CLASSES = ("state",)
"""Classes with no calibration log: they take the largest measured band."""


def arch_class(model: ModelArch) -> str:
    """state (Mamba / GDN / short-conv hybrids) > mla > moe > sliding (mixed window layers) > dense."""
    if model.is_hybrid_state:
        return "state"
    if model.is_mla:
        return "mla"
    if model.is_moe:
        return "moe"
    if len({t for t in model.layer_types if t}) > 1:
        return "sliding"
    return "dense"


def _band(table: dict[str, tuple[int, int]], cls: str) -> tuple[int, int]:
    if cls in table:
        return table[cls]
    return max(o for o, _ in table.values()), max(u for _, u in table.values())


def kv_band(model: ModelArch, version: VllmVersion | None = None, enforce_eager: bool = False) -> tuple[int, int]:
    """(over, under) margin bytes of the KV prediction for this model's class; from 0.21 (CUDA-graph
    estimate inside the KV budget) plus the graph band, unless CUDA graphs are off."""
    if model.pooling:  # embedding / reranker: no decode KV pool to promise
        return 0, 0
    cls = arch_class(model)
    over, under = _band(KV_BAND_CENTI_GIB, cls)
    if version is not None and version.graphs_in_budget and not enforce_eager:
        g_over, g_under = _band(GRAPH_BAND_CENTI_GIB, cls)
        over, under = over + g_over, under + g_under
    return over * GIB // 100, under * GIB // 100
