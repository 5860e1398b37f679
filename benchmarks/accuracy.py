"""Predicted vs observed vLLM start-up memory on the real logs in shared/calibration.

Every case goes through the same code path as `vllmfit estimate --gpu-memory-utilization U`:
memory.estimate(...).vllm, i.e. what vLLM would log for exactly the logged settings.
Prints a table, then (last line) one JSON object with median and max absolute errors.

    python benchmarks/accuracy.py [--calibration DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vllmfit.core import memory
from vllmfit.sources import catalog

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT.parent / "shared" / "calibration"

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
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args()
    rows = load_rows(args.calibration)
    errs: dict[str, list[float]] = {"weights_pct": [], "kv_gib": [], "activation_gib": [], "non_torch_gib": [],
                                    "tokens_pct": []}
    over = []
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
        "activation_median_abs_err_gib": round(statistics.median(errs["activation_gib"]), 3),
        "activation_max_abs_err_gib": round(max(errs["activation_gib"]), 3),
        "non_torch_median_abs_err_gib": round(statistics.median(errs["non_torch_gib"]), 3),
        "kv_tokens_median_err_pct": round(statistics.median(errs["tokens_pct"]), 2) if errs["tokens_pct"] else None,
        "kv_tokens_max_err_pct": round(max(errs["tokens_pct"]), 2) if errs["tokens_pct"] else None,
    }
    print()
    print("targets: weights median <= 2%, KV median <= 1.0 GiB, KV max <= 3 GiB, KV over-prediction <= 1 GiB")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
