"""Memory per pipeline stage: a replica's GPUs differ by the stage they run.

`sizing.size` sizes the fullest stage (every flag is the same on every GPU of a replica); here the
other stages keep that sizing's activation, overhead and flags and change only what vLLM gives
each stage: its layers' weights (`weights.stage_weights_bytes`, the embedding on the first stage,
the LM head on the last) and its layers' KV cache. vLLM v1 gives every rank the same number of KV
blocks, the smallest any rank could hold (v1/core/kv_cache_utils.py `get_kv_cache_configs`: the
ranks' configs are unified to the minimum `num_blocks`), and a stage allocates those blocks for its
own attention layers only, so a stage with fewer layers holds fewer KV bytes."""

from __future__ import annotations

from dataclasses import replace

from vllmfit.core.memory import split
from vllmfit.core.memory.sizing import resolve
from vllmfit.core.memory.types import Footprint, Settings, Sizing
from vllmfit.core.memory.weights import stage_weights_bytes, weights_bytes
from vllmfit.core.model.facts import GpuType, ModelArch, ceil_div


def stage_footprints(model: ModelArch, s: Settings, gpu: GpuType, sizing: Sizing) -> tuple[Footprint, ...]:
    """The footprint of one GPU of each pipeline stage, in stage order; the fullest stage's is
    `sizing.footprint` itself. One stage (pp 1) or the ADR policy: the footprint, on every stage."""
    fp = sizing.footprint
    if s.pp == 1 or s.policy != "vllm":
        return (fp,) * s.pp
    sts = split.stages(model, s.pp)
    layout = resolve(model, s, gpu).layout
    # the layout's block holds ceil(KV layers / pp) layers (kv.kv_layout); one attention group of
    # equal pages: a stage's block is its share of them. Else (sliding, hybrid) every stage books
    # the fullest stage's KV: never less than it holds.
    per_block_layers = ceil_div(sum(st.kv_layers for st in sts), s.pp)
    uniform = (not model.is_hybrid_state and layout.full_groups + layout.sliding_groups == 1
               and per_block_layers and layout.block_bytes % per_block_layers == 0
               and max(st.kv_layers for st in sts) <= per_block_layers)
    blocks = fp.kv_cache // layout.block_bytes if uniform and layout.block_bytes else 0
    page = layout.block_bytes // per_block_layers if uniform else 0
    full = weights_bytes(model, s)
    return tuple(
        replace(fp, weights=fp.weights - (full - stage_weights_bytes(model, s, st)),
                kv_cache=fp.kv_cache - blocks * page * (per_block_layers - st.kv_layers))
        for st in sts)


def rank_footprints(model: ModelArch, s: Settings, gpu: GpuType, sizing: Sizing) -> tuple[Footprint, ...]:
    """The footprint of every rank of a replica, in rank order (tp x pp): rank r runs stage r // tp
    (vLLM's rank = pp_rank x tp + tp_rank)."""
    per_stage = stage_footprints(model, s, gpu, sizing)
    return tuple(per_stage[r // s.tp] for r in range(s.gpus))


def pods(gpus: int, per_node: int, tp: int, stated: int | None = None) -> int | None:
    """How many pods (nodes) one replica of `gpus` GPUs takes on nodes of `per_node` GPUs: `stated`
    when it divides the GPUs into pods that fit a node; else one when they fit one node, else the
    fewest pods that fit, each holding whole tensor-parallel groups (a TP group stays on one node's
    NVLink; `spec.placement.nodes` may split one). None: no such split."""
    if stated is not None:
        return stated if gpus % stated == 0 and gpus // stated <= per_node else None
    for n in range(1, gpus + 1):
        g = gpus // n
        if gpus % n == 0 and g <= per_node and g % tp == 0:
            return n
    return None
