"""`vllmfit calibration --from-log LOG`: a calibration record (vllmfit.core.memory.learned) from a
vLLM start-up log: what the server really used, read from the log's memory lines, against what
vllmfit predicts for the same flags (`estimate`'s), written for `--calibration FILE` to read."""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from vllmfit.cli import estimate
from vllmfit.cli.inputs import hub_argument, read_input
from vllmfit.core import defaults, memory
from vllmfit.core.errors import UserError

LOG_LINES = {  # figure -> the line of vLLM's start-up log (V1 engine) that gives it, in GiB per GPU
    "weights": re.compile(r"Model loading took ([\d.]+) ?GiB"),
    "non_kv": re.compile(r"Total non KV cache memory: ([\d.]+) ?GiB"),
    "kv_cache": re.compile(r"Available KV cache memory: ([\d.]+) ?GiB"),
    "cuda_graphs": re.compile(r"Graph capturing finished in [\d.]+ secs?, took ([\d.]+) ?GiB"),
    "context": re.compile(r"worker init memory snapshot: .*?non_torch_memory=([\d.]+) ?GiB"),
}
"""What `--from-log` reads; every other line is ignored. With several workers (TP, PP), each
figure's largest value (the most-used GPU)."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "calibration",
        help="write a calibration record from a vLLM start-up log",
        description="Read what a vLLM server really used at start-up from its log, size the same deployment "
                    "with vllmfit, and write the record that `estimate --calibration` and `plan --calibration` "
                    "read: a configuration that used more than predicted is then booked with what it used.",
        epilog="Pass the same flags to `vllmfit estimate ... --calibration FILE`: a record applies to exactly "
               "the configuration (model, GPU, vLLM version, TP x PP, memory flags) it was written for.",
    )
    p.add_argument("--from-log", metavar="LOG", required=True,
                   help="a vLLM start-up log (the server's output, DEBUG or INFO level); - reads stdin")
    estimate.configuration_args(p)
    p.add_argument("--out-file", metavar="FILE", help="write the record to FILE instead of stdout")
    hub_argument(p)  # a model the catalog does not know, as estimate reads it
    p.set_defaults(func=run_calibration, calibration=None)


def figures_from_log(text: str, where: str) -> dict[str, int]:
    """The log's memory figures in bytes per GPU (LOG_LINES). Raises UserError without the KV line."""
    out: dict[str, int] = {}
    for name, pattern in LOG_LINES.items():
        found = [float(m.group(1)) for m in pattern.finditer(text)]
        if found:
            out[name] = round(max(found) * defaults.GIB)
    if "kv_cache" not in out:
        raise UserError(f"{where}: no 'Available KV cache memory' line; pass the log of a vLLM server's start-up "
                        "(vLLM's V1 engine, INFO level or more)")
    return out


def observed_bytes(figures: dict[str, int], requested: int | None, where: str) -> int:
    """What the server held on its GPU: what vLLM's profile counts before its KV cache (weights,
    activation peak, non-torch memory: 'Total non KV cache memory', else the requested memory less
    the KV cache), its KV cache, its CUDA graphs and the CUDA context of the start-up snapshot."""
    non_kv = figures.get("non_kv")
    if non_kv is None:
        if requested is None:
            raise UserError(f"{where}: no 'Total non KV cache memory' line (a DEBUG-level log has it); "
                            "pass --gpu-memory-utilization as the server ran it to count the rest")
        non_kv = requested - figures["kv_cache"]
    return non_kv + figures["kv_cache"] + figures.get("cuda_graphs", 0) + figures.get("context", 0)


def run_calibration(args: argparse.Namespace) -> int:
    where = f"--from-log {args.from_log}"
    figures = figures_from_log(read_input(args.from_log), where)
    try:
        est = estimate.estimate_from_args(args)
    except UserError as e:
        raise UserError(estimate.cli_error(str(e))) from None
    u = args.gpu_memory_utilization
    requested = math.ceil(est.capacity_bytes * u) if u else None
    rec = memory.learned.record(
        est.model.name, est.gpu.product, est.settings, est.sizing.footprint.total,
        observed_bytes(figures, requested, where), source=f"vLLM start-up log {Path(args.from_log).name}",
        weights=figures.get("weights"), kv_cache=figures["kv_cache"])
    text = yaml.safe_dump({"records": [rec.as_data()]}, sort_keys=False)
    if args.out_file:
        try:
            Path(args.out_file).write_text(text, encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot write {args.out_file}: {e.strerror or e}") from None
    else:
        sys.stdout.write(text)
    over = rec.observed_bytes - rec.predicted_bytes
    said = (f"used {memory.fmt_gib(over)} more than predicted: --calibration books it" if over > 0 else
            "used no more than predicted: --calibration changes nothing")
    print(f"{'wrote the record to ' + args.out_file if args.out_file else 'the record'}: {said}", file=sys.stderr)
    return 0
