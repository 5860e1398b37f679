"""What a configuration really used at its first start, and the correction it teaches (issue 34).

A learned record says: this configuration -- (model, quantization, GPU product, vLLM version,
TP x PP, the memory-relevant flags) -- was predicted `predicted_bytes` per GPU and the node agent
measured `observed_bytes` (NVML, the replica's processes on its most-used GPU, once started).
Weights and KV cache are recorded where they are known (vLLM's log or metrics); the total always.

The correction rule: a later prediction of the same configuration books

    predicted_now + max(0, observed - predicted_then)

per GPU, i.e. the observed figure when it is larger (and the same over-run when the prediction of
the same configuration moved, e.g. a larger KV grant for the room another GPU left). A smaller
observed figure never lowers a prediction: the prediction stays the floor. The added bytes are
`Footprint.learned`: booked, but not in vLLM's flags (vLLM sizes its KV cache from its own flags;
the over-run is memory outside what vLLM budgets, which only booking more room can cover).

`size` is `sizing.size` with that rule applied; `memory.size` is this function, so every decision
(webhook, operator, `vllmfit plan`) books the same. The records travel in `Settings.learned`
(only those of the model being sized), filled by the shells from the operator's ConfigMap or a
`--calibration FILE`. Pure: no I/O; the records are plain data (JSON/YAML read by the shells).

A record cannot be poisoned by a tenant: it is taught by a replica's first start only (the
operator's `teach`), kept per namespace (`namespace`; "" is cluster-wide: taught in the operator's
own namespace or written by an admin), and a corrected deployment reads only its own namespace's
records and the cluster-wide ones (`for_model`). An over-run beyond `overrun_bound` teaches nothing
(the shell flags that deployment instead), and a record ages out `defaults.LEARNED_RECORD_TTL_SECONDS`
after it was taught (`current`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from vllmfit.core import defaults, limits
from vllmfit.core.errors import UserError
from vllmfit.core.memory import sizing as _sizing
from vllmfit.core.memory.types import Settings, Sizing, fmt_gib
from vllmfit.core.memory.versions import parse_version
from vllmfit.core.model.facts import GpuType, ModelArch

_FLAG_FIELDS = (
    "dtype", "kv_cache_dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "gpu_memory_utilization", "enforce_eager", "block_size", "kv_tokens", "kv_bytes", "kv_concurrency",
    "typical_len", "kv_grow", "lora_max_loras", "lora_max_rank", "lora_dtype", "cpu_offload_bytes", "policy",
)
_DEFAULTS = Settings()


def flags_text(s: Settings) -> str:
    """The memory-relevant settings that differ from vLLM's defaults, as `name=value` pairs."""
    out = []
    for name in _FLAG_FIELDS:
        v = getattr(s, name)
        if v != getattr(_DEFAULTS, name):
            out.append(f"{name}={v}")
    return ",".join(out)


def config_key(model: str, gpu: str, s: Settings) -> str:
    """One configuration: model, quantization, GPU product, vLLM version, TP x PP, flags."""
    return _key(model, s.quantization or "auto", gpu, parse_version(s.vllm_version)[0].label, s.tp, s.pp,
                flags_text(s))


def _key(model: str, quantization: str, gpu: str, version: str, tp: int, pp: int, flags: str) -> str:
    """The one spelling of a configuration's key: what a stored record and a new sizing match on."""
    return f"{model}|{quantization}|{gpu}|vllm {version}|tp {tp} pp {pp}|{flags}"


def overrun_bound(predicted: int) -> int:
    """The largest over-run a first start may teach (limits.LEARNED_OVERRUN_*)."""
    return max(limits.LEARNED_OVERRUN_MIN_BYTES, predicted // limits.LEARNED_OVERRUN_FRACTION_DENOMINATOR)


@dataclass(frozen=True)
class Record:
    """One configuration's first finished start: predicted and observed bytes per GPU."""

    model: str
    quantization: str
    gpu: str
    vllm_version: str
    tp: int
    pp: int
    flags: str
    predicted_bytes: int
    observed_bytes: int
    observed_weights_bytes: int | None = None
    observed_kv_cache_bytes: int | None = None
    source: str = ""  # who was measured where and when (a deployment, replica, node, GPU, sampledAt)
    namespace: str = ""  # whose deployments it corrects ("": every namespace's; the operator's or an admin's)
    learned_at: int = 0  # when it was taught (seconds since the epoch; 0: read before it was stamped)

    @property
    def config(self) -> str:
        return _key(self.model, self.quantization, self.gpu, self.vllm_version, self.tp, self.pp, self.flags)

    @property
    def key(self) -> str:
        return f"{self.namespace}|{self.config}"

    @property
    def excess(self) -> int:
        """How much more than predicted it used (0 when it used less)."""
        return max(0, self.observed_bytes - self.predicted_bytes)

    def as_data(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model, "quantization": self.quantization, "gpu": self.gpu,
            "vllmVersion": self.vllm_version, "tp": self.tp, "pp": self.pp, "flags": self.flags,
            "predictedBytes": self.predicted_bytes, "observedBytes": self.observed_bytes,
        }
        if self.observed_weights_bytes is not None:
            out["observedWeightsBytes"] = self.observed_weights_bytes
        if self.observed_kv_cache_bytes is not None:
            out["observedKvCacheBytes"] = self.observed_kv_cache_bytes
        if self.source:
            out["source"] = self.source
        if self.namespace:
            out["namespace"] = self.namespace
        if self.learned_at:
            out["learnedAt"] = self.learned_at
        return out


def record(model: str, gpu: str, s: Settings, predicted: int, observed: int, source: str = "",
           weights: int | None = None, kv_cache: int | None = None, *, namespace: str = "",
           learned_at: int = 0) -> Record:
    """The record of one finished start of `model` with settings `s` on a `gpu` product, taught in
    `namespace` ("": cluster-wide) at `learned_at`."""
    return Record(model, s.quantization or "auto", gpu, parse_version(s.vllm_version)[0].label, s.tp, s.pp,
                  flags_text(s), predicted, observed, weights, kv_cache, source, namespace, learned_at)


def _int(d: Mapping[str, Any], name: str, where: str, *, required: bool = True, lo: int = 0,
         hi: int = limits.MAX_GPU_MEMORY_BYTES) -> int | None:
    v = d.get(name)
    if v is None and not required:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise UserError(f"{where}: {name} must be an integer in {lo}..{hi}, got {str(v)[:40]!r}")
    return v


def _str(d: Mapping[str, Any], name: str, where: str, default: str | None = None) -> str:
    v = d.get(name, default)
    if not isinstance(v, str) or len(v) > 1000:
        raise UserError(f"{where}: {name} must be a string of at most 1000 characters")
    return v


def records_from_data(data: Any) -> list[Record]:
    """Records from parsed JSON/YAML: `{"records": [...]}` or a bare list (the shells unwrap a
    ConfigMap's CALIBRATION_KEY first). Raises UserError (one line) on anything else."""
    items = data.get("records") if isinstance(data, Mapping) else data
    if not isinstance(items, list):
        raise UserError("calibration: expected a list of records (or {records: [...]}, or the ConfigMap)")
    if len(items) > defaults.MAX_CALIBRATION_RECORDS:
        raise UserError(f"calibration: {len(items)} records, more than {defaults.MAX_CALIBRATION_RECORDS}")
    out = []
    for i, d in enumerate(items):
        where = f"calibration record {i}"
        if not isinstance(d, Mapping):
            raise UserError(f"{where}: not a mapping")
        out.append(Record(
            model=_str(d, "model", where), quantization=_str(d, "quantization", where, "auto"),
            gpu=_str(d, "gpu", where), vllm_version=_str(d, "vllmVersion", where),
            tp=_int(d, "tp", where, lo=1, hi=limits.MAX_TP) or 1, pp=_int(d, "pp", where, lo=1, hi=limits.MAX_PP) or 1,
            flags=_str(d, "flags", where, ""),
            predicted_bytes=_int(d, "predictedBytes", where) or 0, observed_bytes=_int(d, "observedBytes", where) or 0,
            observed_weights_bytes=_int(d, "observedWeightsBytes", where, required=False),
            observed_kv_cache_bytes=_int(d, "observedKvCacheBytes", where, required=False),
            source=_str(d, "source", where, ""), namespace=_str(d, "namespace", where, ""),
            learned_at=_int(d, "learnedAt", where, required=False, hi=limits.MAX_EPOCH_SECONDS) or 0,
        ))
    return out


def current(records: Iterable[Record], now: int, ttl: int = defaults.LEARNED_RECORD_TTL_SECONDS) -> list[Record]:
    """The records not aged out at `now` (seconds since the epoch); one never stamped is stamped
    `now` (it ages out a TTL after it was first read)."""
    return [r if r.learned_at else replace(r, learned_at=now) for r in records if not r.learned_at
            or r.learned_at + ttl > now]


def learn(records: Iterable[Record], new: Record) -> list[Record]:
    """The records with `new` taken in: one record per configuration, the one with the larger
    over-run wins (a later start that used less never un-teaches an over-run); sorted by key."""
    by_key = {r.key: r for r in records}
    old = by_key.get(new.key)
    if old is None or new.excess > old.excess:
        by_key[new.key] = new
    return [by_key[k] for k in sorted(by_key)][: defaults.MAX_CALIBRATION_RECORDS]


def for_model(records: Iterable[Record], model: str,
              namespace: str | None = None) -> tuple[tuple[str, int, int, str], ...]:
    """What `Settings.learned` carries for `model` in `namespace`: (config key, predicted, observed,
    source), over-runs only, from that namespace's records and the cluster-wide ones (None: every
    record, a `--calibration` file's), the larger over-run of a configuration."""
    best: dict[str, Record] = {}
    for r in records:
        if r.model != model or r.excess <= 0 or (namespace is not None and r.namespace not in ("", namespace)):
            continue
        if r.config not in best or r.excess > best[r.config].excess:
            best[r.config] = r
    return tuple(sorted((k, r.predicted_bytes, r.observed_bytes, _taught_by(r)) for k, r in best.items()))


def _taught_by(r: Record) -> str:
    where = f"namespace {r.namespace}" if r.namespace else "cluster-wide"
    return f"{r.source or r.config}; {where}"


def correction(model: str, gpu: str, s: Settings) -> tuple[int, str] | None:
    """(bytes to book above the prediction, where that was learned) for this configuration, or None."""
    key = config_key(model, gpu, s)
    for k, predicted, observed, source in s.learned:
        if k == key and observed > predicted:
            return observed - predicted, source
    return None


def size(model: ModelArch, s: Settings, gpu: GpuType, available: int) -> Sizing:
    """`sizing.size`, with a learned over-run of the same configuration booked on top (module
    docstring). The over-run's bytes are taken out of `available` before sizing, so a KV cache that
    grows into the room (kv grant `room`, kvCache.grow) or a context that gives way leaves them
    free, and the booking is what was sized plus the over-run."""
    hit = correction(model.name, gpu.product, s) if s.learned else None
    if hit is None:
        return _sizing.size(model, s, gpu, available)
    extra, source = hit
    room = available if available >= _sizing.UNLIMITED else max(available - extra, 0)
    sized = _sizing.size(model, s, gpu, room)
    fp = replace(sized.footprint, learned=extra)
    note = (f"booked {fmt_gib(fp.total)} per GPU instead of the predicted {fmt_gib(sized.footprint.total)}: "
            f"this configuration used {fmt_gib(extra)} more at its first start ({source})")
    fits = sized.fits and fp.total <= available
    reasons = sized.reasons
    if fp.total > available:  # the budget reason in the words of the booking, not of the room sized for
        reasons = (f"needs {fmt_gib(fp.total)} per GPU with the learned over-run, {fmt_gib(available)} available",
                   *(r for r in sized.reasons if not r.startswith("needs ")))
    return replace(sized, fits=fits, footprint=fp, warnings=(*sized.warnings, note), reasons=reasons)
