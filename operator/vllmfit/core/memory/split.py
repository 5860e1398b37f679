"""How vLLM splits a model's decoder layers into pipeline stages, and what each stage holds.

vllm/distributed/utils.py `get_pp_indices`: every stage gets layers // pp; the remainder goes one
layer each to the stages before the last, from the second-to-last backwards (the last stage also
runs the final norm and the LM head). `VLLM_PP_LAYER_PARTITION` ("31,30") overrides it: as many
counts as stages, summing to the layers. A tenant cannot set that variable (it is not on the vllm
container's env allow-list), so a deployment runs the default split; `partition(..., override)`
is its rule for callers that know one. The first stage holds the input embedding, the last the
final norm and the LM head (`make_layers`, and each model's `is_first_rank` / `is_last_rank`)."""

from __future__ import annotations

from dataclasses import dataclass

from vllmfit.core.model.facts import ModelArch


def partition(num_layers: int, pp: int, override: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The decoder layers of each stage, as vLLM's `get_pp_indices` splits them. Raises ValueError
    (vLLM's own check) when `override` has the wrong number of stages or does not sum to the layers."""
    if override is not None:
        if len(override) != pp:
            raise ValueError(f"a layer partition of {len(override)} stages does not match pipelineParallelSize {pp}")
        if sum(override) != num_layers:
            raise ValueError(f"a layer partition summing to {sum(override)} does not match the {num_layers} layers")
        return tuple(override)
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its decoder layers [start, end), how many of them are MoE, dense-MLP
    and KV-carrying (attention) layers, and whether it holds the embedding (first) or the head (last)."""

    index: int
    start: int
    end: int
    moe: int
    dense: int
    kv_layers: int
    first: bool
    last: bool

    @property
    def layers(self) -> int:
        return self.end - self.start


def _mlp_kind(model: ModelArch, i: int) -> str:
    if model.mlp_kinds:
        return model.mlp_kinds[i] if i < len(model.mlp_kinds) else "dense"
    return "moe" if model.is_moe and i >= model.first_k_dense else "dense"


def _has_kv(model: ModelArch, i: int) -> bool:
    return not model.layer_types or (i < len(model.layer_types) and model.layer_types[i] != "")


def stages(model: ModelArch, pp: int, override: tuple[int, ...] | None = None) -> tuple[Stage, ...]:
    """The stages of `model` at pipelineParallelSize `pp` (one stage when pp is 1)."""
    out, start = [], 0
    parts = partition(model.num_layers, pp, override)
    for k, n in enumerate(parts):
        end = start + n
        kinds = [_mlp_kind(model, i) for i in range(start, end)]
        out.append(Stage(k, start, end, kinds.count("moe"), kinds.count("dense"),
                         sum(1 for i in range(start, end) if _has_kv(model, i)), k == 0, k == len(parts) - 1))
        start = end
    return tuple(out)
