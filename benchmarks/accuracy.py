"""Predicted vs observed vLLM start-up memory on real vLLM start-up logs (tests/data/calibration).

Every case goes through the same code path as `vllmfit estimate --gpu-memory-utilization U`:
memory.estimate(...).vllm, i.e. what vLLM would log for exactly the logged settings.
Prints a table, then (last line) one JSON object with median and max absolute errors.

The closed loop (issue 34): `learned_*` keys say what the operator's learned corrections
(vllmfit.core.memory.learned) would have done on these logs. A log's over-run is the KV cache
vllmfit promised beyond what vLLM found (predicted - observed KV): with the KV request injected as
--kv-cache-memory-bytes, that is memory the process holds beyond its booking. Leave-one-out per
configuration: each log is predicted with the record learned from the other logs of the same
configuration (model, quantization, dtypes, GPU, vLLM version, TP x PP, context, batch, eager; the
operator's key), booked + max(0, their over-run); and, as a looser key for comparison, learn on the
first log of each (model, GPU, vLLM version) and predict the rest.

    python benchmarks/accuracy.py [--calibration DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from vllmfit.core import defaults, memory
from vllmfit.core.memory import margin
from vllmfit.core.memory.overhead import graph_bytes
from vllmfit.sources import catalog

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "tests" / "data" / "calibration"
"""The 52 public vLLM start-up records, in the repository (tests/data/calibration/README.md: sources)."""
OVER_LIMIT_GIB = 0.5

_QUANT = {"fp8": "fp8"}  # quantization applied online to an unquantized checkpoint
_DTYPE = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "auto": "auto"}


def load_rows(directory: Path) -> list[dict]:
    path = directory / "vllm_startup_logs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def version_of(row: dict) -> str:
    v = str(row.get("vllm_version", ""))
    return v if v[:1].isdigit() else "0.11"  # "not stated (~0.10.x/0.11 ...)"


def settings_of(row: dict) -> memory.Settings:
    return memory.Settings(
        tp=row["tensor_parallel_size"],
        pp=row["pipeline_parallel_size"],
        dtype=_DTYPE.get(row["dtype"], "auto"),
        quantization=_QUANT.get(row["quantization"]),
        kv_cache_dtype="fp8" if row["kv_cache_dtype"] == "fp8" else "auto",
        max_model_len=row["max_model_len"],
        max_num_seqs=row["max_num_seqs"] or 1024,
        max_num_batched_tokens=row["max_num_batched_tokens"],
        gpu_memory_utilization=row["gpu_memory_utilization"],
        enforce_eager=bool(row["enforce_eager"]),
        vllm_version=version_of(row),
    )


def is_hybrid(model) -> bool:
    return len({t for t in model.layer_types if t}) > 1


def predict(row: dict) -> dict:
    model = catalog.model(row["model"])
    gpu = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    s = settings_of(row)
    est = memory.estimate(model, s, gpu)
    v = est.vllm
    assert v is not None
    return {
        "weights": v.weights_bytes / GIB,
        "activation": v.activation_peak_bytes / GIB,
        "non_torch": v.non_torch_bytes / GIB,
        "kv": v.kv_cache_bytes / GIB,
        "tokens": v.kv_cache_tokens,
        "hybrid": is_hybrid(model),
        "class": margin.arch_class(model),
        "kv_low": v.kv_cache_low_bytes / GIB,
        "kv_high": v.kv_cache_high_bytes / GIB,
    }


def graph_residuals(rows: list[dict]) -> dict[str, list[float]]:
    """Per class: vLLM's logged CUDA-graph estimate minus vllmfit's graph prediction, GiB (from 0.21
    vLLM subtracts its estimate from the KV budget)."""
    out: dict[str, list[float]] = {}
    for row in rows:
        if row.get("cuda_graph_estimate_gib") is None or row["enforce_eager"]:
            continue
        model = catalog.model(row["model"])
        pred = graph_bytes(model, settings_of(row)) / GIB
        out.setdefault(margin.arch_class(model), []).append(row["cuda_graph_estimate_gib"] - pred)
    return out


def measured_bands(residuals: dict[str, list[float]]) -> dict[str, tuple[int, int]]:
    """(over, under) per class in 0.01 GiB: the worst residual plus the logs' rounding, rounded up
    (the rule memory.margin's constants follow)."""
    out = {}
    for cls, res in sorted(residuals.items()):
        over = max(0.0, max(res)) + margin.LOG_ROUNDING_GIB
        under = max(0.0, -min(res)) + margin.LOG_ROUNDING_GIB
        out[cls] = (math.ceil(round(over * 100, 6)), math.ceil(round(under * 100, 6)))
    return out


def config_of(row: dict) -> tuple:
    """The learned record's configuration key for a log (--gpu-memory-utilization excluded: with
    the KV request injected vLLM's footprint does not depend on it)."""
    return (row["model"], row["quantization"], row["dtype"], row["kv_cache_dtype"], row["gpu"], version_of(row),
            row["tensor_parallel_size"], row["pipeline_parallel_size"], row["max_model_len"], row["max_num_seqs"],
            row["max_num_batched_tokens"], bool(row["enforce_eager"]))


def learned_corrections(rows: list[dict], over: list[float]) -> dict:
    """What the learned correction (book + max(0, the record's over-run)) would have done."""
    by_config: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        by_config.setdefault(config_of(row), []).append(i)
    loo_before, loo_after, loo_extra = [], [], []
    for idx in by_config.values():
        for i in idx if len(idx) > 1 else ():
            correction = max(0.0, *(over[j] for j in idx if j != i))
            loo_before.append(over[i])
            loo_after.append(over[i] - correction)
            loo_extra.append(correction)
    by_model: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        by_model.setdefault((row["model"], row["gpu"], version_of(row)), []).append(i)
    first_before, first_after = [], []
    for idx in by_model.values():
        correction = max(0.0, over[idx[0]])
        for i in idx[1:]:
            first_before.append(over[i])
            first_after.append(over[i] - correction)
    print()
    print("learned corrections (issue 34): over-run = predicted KV - observed KV, GiB")
    print(f"{'split':<44} {'logs':>5} {'max over-run before/after':>26} {'> 0.5 GiB before/after':>23}")
    for name, before, after in (("leave-one-out, same configuration", loo_before, loo_after),
                                ("learn first, predict rest (model x GPU x vLLM)", first_before, first_after)):
        if before:
            print(f"{name:<44} {len(before):>5} {max(before):>12.3f}/{max(after):<13.3f} "
                  f"{sum(o > OVER_LIMIT_GIB for o in before):>11}/{sum(o > OVER_LIMIT_GIB for o in after):<11}")
    return {
        "learned_loo_logs_count": len(loo_before),
        "learned_loo_max_overrun_before_gib": round(max(loo_before), 3) if loo_before else None,
        "learned_loo_max_overrun_after_gib": round(max(loo_after), 3) if loo_after else None,
        "learned_loo_overrun_over_0_5_gib_before_count": sum(o > OVER_LIMIT_GIB for o in loo_before),
        "learned_loo_overrun_over_0_5_gib_after_count": sum(o > OVER_LIMIT_GIB for o in loo_after),
        "learned_loo_mean_extra_booked_gib": round(statistics.mean(loo_extra), 3) if loo_extra else None,
        "learned_first_logs_count": len(first_before),
        "learned_first_max_overrun_before_gib": round(max(first_before), 3) if first_before else None,
        "learned_first_max_overrun_after_gib": round(max(first_after), 3) if first_after else None,
        "learned_first_overrun_over_0_5_gib_before_count": sum(o > OVER_LIMIT_GIB for o in first_before),
        "learned_first_overrun_over_0_5_gib_after_count": sum(o > OVER_LIMIT_GIB for o in first_after),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args()
    rows = load_rows(args.calibration)
    errs: dict[str, list[float]] = {"weights_pct": [], "kv_gib": [], "activation_gib": [], "non_torch_gib": [],
                                    "tokens_pct": []}
    over = []
    floor_over = []
    outside = 0
    residuals: dict[str, list[float]] = {}
    print(f"{'case':<52} {'W pred/obs':>13} {'act pred/obs':>13} {'nt pred/obs':>12} {'KV pred/obs GiB':>16} "
          f"{'KV tokens pred/obs':>22}")
    for row in rows:
        p = predict(row)
        obs_kv = row["kv_cache_gib"]
        errs["weights_pct"].append(abs(p["weights"] - row["weights_gib"]) / row["weights_gib"] * 100)
        errs["kv_gib"].append(abs(p["kv"] - obs_kv))
        errs["activation_gib"].append(abs(p["activation"] - row["activation_peak_gib"]))
        errs["non_torch_gib"].append(abs(p["non_torch"] - row["non_torch_gib"]))
        over.append(p["kv"] - obs_kv)
        floor_over.append(p["kv_low"] - obs_kv)
        outside += not p["kv_low"] - 0.005 <= obs_kv <= p["kv_high"] + 0.005
        residuals.setdefault(p["class"], []).append(p["kv"] - obs_kv)
        tok = row.get("kv_cache_tokens")
        if tok and not p["hybrid"]:
            errs["tokens_pct"].append(abs(p["tokens"] - tok) / tok * 100)
        print(f"{row['id'][:52]:<52} {p['weights']:6.2f}/{row['weights_gib']:<6.2f} "
              f"{p['activation']:6.2f}/{row['activation_peak_gib']:<6.2f} {p['non_torch']:5.2f}/{row['non_torch_gib']:<6.2f} "
              f"{p['kv']:7.2f}/{obs_kv:<8.2f} {p['tokens']:>10}/{tok or '-':<11}")
    summary = {
        "cases": len(rows),
        "weights_median_err_pct": round(statistics.median(errs["weights_pct"]), 2),
        "weights_max_err_pct": round(max(errs["weights_pct"]), 2),
        "kv_median_abs_err_gib": round(statistics.median(errs["kv_gib"]), 3),
        "kv_max_abs_err_gib": round(max(errs["kv_gib"]), 3),
        "kv_max_overpredict_gib": round(max(over), 3),
        "kv_overpredicted_over_0_5_gib_count": sum(1 for o in over if o > OVER_LIMIT_GIB),
        "kv_floor_max_overpredict_gib": round(max(floor_over), 3),
        "kv_floor_overpredicted_over_0_5_gib_count": sum(1 for o in floor_over if o > OVER_LIMIT_GIB),
        "kv_outside_predicted_range_count": outside,
        "activation_median_abs_err_gib": round(statistics.median(errs["activation_gib"]), 3),
        "activation_max_abs_err_gib": round(max(errs["activation_gib"]), 3),
        "non_torch_median_abs_err_gib": round(statistics.median(errs["non_torch_gib"]), 3),
        "kv_tokens_median_err_pct": round(statistics.median(errs["tokens_pct"]), 2) if errs["tokens_pct"] else None,
        "kv_tokens_max_err_pct": round(max(errs["tokens_pct"]), 2) if errs["tokens_pct"] else None,
    }
    # the counted budget counts one lone server's CUDA context outside R (defaults.COUNTED_CONTEXT_BYTES):
    # it must be at least what a one-GPU vLLM logs as its start-up non-torch memory (its context),
    # or the default budget would admit more than a lone vLLM at --gpu-memory-utilization u uses
    contexts = [row["extra"]["init_non_torch_gib"] for row in rows if row["tensor_parallel_size"] *
                row["pipeline_parallel_size"] == 1 and (row.get("extra") or {}).get("init_non_torch_gib") is not None]
    counted = defaults.COUNTED_CONTEXT_BYTES / GIB
    summary["budget_context_gib"] = round(counted, 3)
    summary["logged_context_tp1_max_gib"] = max(contexts) if contexts else None
    summary["logged_context_above_budget_context_count"] = sum(1 for c in contexts if c > counted + 0.005)
    bands = measured_bands(residuals)
    print()
    print(f"budget context (counted): {counted:.3f} GiB; one-GPU start-up contexts logged: {len(contexts)}, "
          f"largest {max(contexts, default=0):.2f} GiB, above the budget's: "
          f"{summary['logged_context_above_budget_context_count']}")
    print(f"{'class':<9} {'logs':>4} {'worst over GiB':>15} {'worst under GiB':>16}  measured band (0.01 GiB)  in memory.margin")
    for cls, res in sorted(residuals.items()):
        print(f"{cls:<9} {len(res):>4} {max(res):>15.3f} {-min(res):>16.3f}  {bands[cls]!s:<24}  "
              f"{margin.KV_BAND_CENTI_GIB.get(cls)}")
    graph_bands = measured_bands(graph_residuals(rows))
    for cls, band in graph_bands.items():
        print(f"{cls:<9} CUDA-graph estimate band from 0.21 (0.01 GiB): measured {band}, in memory.margin "
              f"{margin.GRAPH_BAND_CENTI_GIB.get(cls)}")
    summary.update(learned_corrections(rows, over))
    summary["kv_band_matches_measured"] = all(margin.KV_BAND_CENTI_GIB.get(c) == b for c, b in bands.items()) and \
        all(margin.GRAPH_BAND_CENTI_GIB.get(c) == b for c, b in graph_bands.items())
    print()
    print("targets: weights median <= 2%, KV median <= 1.0 GiB, KV max <= 3 GiB, "
          "KV over-predicted by > 0.5 GiB: 0 cases; logged contexts above the budget's: 0")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
