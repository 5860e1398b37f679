"""What a review answers, from a snapshot of the ledger: no Kopf, no I/O. `check` is the verdict
of the validating webhook (the same `placement.decide` as the operator and `vllmfit plan`), and
`defaults_patch` / `json_patch` the mutating webhook's patch. `vllmfit.operator.admission.webhook`
reads the request and calls them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from vllmfit.core import placement
from vllmfit.core.spec import api
from vllmfit.operator.booking.changes import memory_changes


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    message: str = ""
    warnings: tuple[str, ...] = ()
    code: int = 200  # for denials: 403 does not fit, 422 invalid spec, 400 anything else


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model class of a field annotation (`X`, `X | None`), if it is one."""
    candidates = get_args(annotation) if get_origin(annotation) in (Union, type(int | None)) else (annotation,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def defaults_patch(spec: Mapping[str, Any], model: type[BaseModel] = api.VLLMDeploymentSpec,
                   overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The merge patch that adds every default of `model` that `spec` leaves out, recursing into
    nested objects that are present. Defaults of None or [] mean "unset" and are not written.
    `overrides` replace top-level defaults (the operator's --default-image for `image`)."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in spec:
            if field.is_required():
                continue
            value = (overrides or {}).get(key, field.get_default(call_default_factory=True))
            if isinstance(value, BaseModel):
                value = value.model_dump(mode="json", by_alias=True, exclude_none=True)
            if value not in (None, [], {}):
                out[key] = value
        elif (sub := _model_of(field.annotation)) is not None and isinstance(spec[key], Mapping):
            inner = defaults_patch(spec[key], sub)
            if inner:
                out[key] = inner
    return out


SMALLER_NEEDS_LESS = frozenset(
    {"replicas", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"})
"""Spec fields whose lower value never needs more memory on any GPU."""


def is_shrink(old: api.VLLMDeploymentSpec, new: api.VLLMDeploymentSpec) -> bool:
    """True when `new` only lowers numbers that memory grows with (replicas, context, sequences,
    batched tokens, utilization, LoRA slots and rank), offloads more weights to CPU or turns
    enforceEager on: it cannot need more on any GPU."""
    changed = memory_changes(old, new)
    return bool(changed) and all(
        (n == "enforce_eager" and new.enforce_eager)
        or (n == "kv_cache" and _kv_shrink(old.kv_cache, new.kv_cache))
        or (n == "lora" and _lora_shrink(old.lora, new.lora))
        or (n == "cpu_offload" and new.cpu_offload_bytes > old.cpu_offload_bytes)
        or (n in SMALLER_NEEDS_LESS and getattr(old, n) is not None and getattr(new, n) is not None
            and getattr(new, n) < getattr(old, n))
        for n in changed
    )


def _lora_shrink(old: api.LoraSpec | None, new: api.LoraSpec | None) -> bool:
    """LoRA removed, or fewer slots / a lower rank in the same dtype."""
    if old is None:
        return False
    if new is None:
        return True
    return (new.lora_dtype == old.lora_dtype and new.max_loras <= old.max_loras
            and new.max_lora_rank <= old.max_lora_rank)


def _kv_shrink(old: api.KvCacheSpec | None, new: api.KvCacheSpec | None) -> bool:
    """The same kind of KV request, lowered (tokens, memory or concurrency; typicalLength and grow
    unchanged)."""
    if old is None or new is None:
        return False
    if (old.typical_length, old.grow) != (new.typical_length, new.grow) or new.grow:
        return False
    pairs = [(old.tokens, new.tokens), (old.memory_bytes, new.memory_bytes), (old.concurrency, new.concurrency)]
    if any((a is None) != (b is None) for a, b in pairs):
        return False
    return all(b <= a for a, b in pairs if a is not None and b is not None) and old != new


def _where(d: placement.Decision) -> str:
    return ", ".join(f"{r.node} GPU {list(r.gpus)}" for r in d.replicas)


def _elsewhere(ledger: placement.Ledger, req: placement.Request) -> str:
    """Where the request would fit if it were not pinned ('' if nowhere)."""
    free = req.spec.placement.model_copy(update={"node_name": None, "gpu_indices": None})
    d = placement.decide(ledger, replace(req, spec=req.spec.model_copy(update={"placement": free})), suggest=False)
    return _where(d) if d.admitted else ""


def check(ledger: placement.Ledger, req: placement.Request, *, old: api.VLLMDeploymentSpec | None = None,
          dry_run: bool = False, old_flags: api.Flags | None = None, quick: bool = False) -> Verdict | None:
    """The verdict for `req` on `ledger` (read only). `old`: the stored spec, on an UPDATE, and
    `old_flags` its status.flags. A change of spec.replicas alone (kubectl scale, an HPA) keeps the
    replicas it holds where they are, as the operator does: only new replicas must fit.
    With `quick`, one decision without fixes: the verdict when it is admitted or rejected, None
    when it does not fit (then the refusal, with its checked fixes, needs `check` in full)."""
    keep: list[placement.ReplicaAllocation] = []
    if old is not None and memory_changes(old, req.spec) == ["replicas"]:
        keep = placement.held_replicas(ledger, req.key, min(old.replicas, req.spec.replicas), old_flags)
    d = placement.decide(ledger, req, keep=keep, explain=not quick)
    if quick and not d.admitted and d.phase != "Rejected":
        return None
    if d.admitted:
        extra: tuple[str, ...] = ()
        if dry_run:
            flags = " ".join(d.flags.args()) if d.flags else ""
            extra = (f"dry run: would be placed on {_where(d)} with {flags}; nothing was booked",)
        return Verdict(True, warnings=d.warnings + extra)
    if d.phase == "Rejected":
        return Verdict(False, "; ".join(d.reasons) or d.message, d.warnings, 422)
    if old is not None and is_shrink(old, req.spec):
        return Verdict(True, warnings=(*d.warnings, f"admitted because it needs less than before, but: {d.message}"))
    msg = d.message
    pin = req.spec.placement
    if pin.node_name and not pin.allow_reschedule and (where := _elsewhere(ledger, req)):
        msg += f". It fits on {where}: pin it there or set placement.allowReschedule: true"
    return Verdict(False, msg, d.warnings, 403)


def finalizer_ops(metadata: Any) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that puts api.FINALIZER on a VLLMDeployment being created, as
    the mutating webhook does: the object then arrives with it, and Kopf does not patch it on
    (its patch is guarded by the resourceVersion it read, so a status written first made it fail
    and go again, a request and a re-read of the whole object each time). Empty when it has it."""
    if not isinstance(metadata, Mapping):
        return []  # not an object: the API server refuses it, nothing to add to
    held = metadata.get("finalizers")
    if held is None:
        return [{"op": "add", "path": "/metadata/finalizers", "value": [api.FINALIZER]}]
    if not isinstance(held, list) or api.FINALIZER in held:
        return []  # not a list (the API server refuses it), or there already
    return [{"op": "add", "path": "/metadata/finalizers/-", "value": api.FINALIZER}]


def json_patch(target: Mapping[str, Any], merge: Mapping[str, Any], path: str) -> list[dict[str, Any]]:
    """The JSON patch (RFC 6902) that applies the merge patch `merge` to the object `target` at
    `path`, for what `defaults_patch` returns: keys that `target` lacks are added whole, objects
    it has are recursed into."""
    ops: list[dict[str, Any]] = []
    for key, value in merge.items():
        at = f"{path}/{key.replace('~', '~0').replace('/', '~1')}"
        if isinstance(value, Mapping) and isinstance(target.get(key), Mapping):
            ops += json_patch(target[key], value, at)
        else:
            ops.append({"op": "add", "path": at, "value": value})  # RFC 6902: "add" replaces a member
    return ops
