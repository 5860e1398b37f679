"""vLLM itself as the oracle (issue 23, docs/oracle.md): vllmfit's core against what vLLM's own
start-up code decided for the same config, GPU and flags (tests/data/vllm-oracle/<version>.json,
written by `make oracle VLLM=<version>`; no vLLM is needed here).

Per case, compared with vLLM's answer:
- admission: vllmfit refuses the spec (SpecError, ModelConfigError, or one request of
  max_model_len does not fit the KV memory) exactly when vLLM refuses to start;
- the resolved max_model_len and the scheduler defaults (max_num_seqs, max_num_batched_tokens);
- KV cache groups, the pool bytes of one block, the number of blocks, and the KV tokens vLLM logs.

A case is exact, conservative (vllmfit promises fewer KV tokens, or refuses what vLLM starts),
or over-promising (more tokens than vLLM, or admitting what vLLM refuses). Over-promises fail.
Conservative differences must be listed in CONSERVATIVE with the worst ratio they may reach
(vllmfit tokens / vLLM tokens), each with the reason. Other differences (batch defaults, groups,
block size with equal tokens) must be listed in KNOWN_DIFFERENCES.

`python tests/test_vllm_oracle.py` prints the agreement table per version.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllmfit.core.memory.sizing import resolve
from vllmfit.core.memory.types import Settings, SpecError
from vllmfit.core.model.config import parse_hf_config
from vllmfit.core.model.facts import ModelConfigError
from vllmfit.sources import catalog

DATA = Path(__file__).parent / "data"
FIXTURES = sorted((DATA / "vllm-oracle").glob("*.json"))
CONFIGS = DATA / "hf-configs"

# (model stem, what) -> (worst ratio of vllmfit's KV tokens to vLLM's, why). Each entry is a rule
# vllmfit keeps on purpose; the ratio bounds it (a case below it fails).
CONSERVATIVE: dict[tuple[str, str], tuple[float, str]] = {}

# (model stem, field) -> why a non-capacity field differs (never an over-promise).
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {}

# Oracle cases vLLM could not run in this CPU-only harness (not vLLM refusals): skipped, counted.
ENVIRONMENT_ERRORS = re.compile(r"NVIDIA driver|CUDA (error|driver)|libcuda|cudaError|nvml|NVML", re.IGNORECASE)


@dataclass
class Verdict:
    kind: str  # exact | conservative | over | differs | skipped
    ratio: float = 1.0
    details: list[str] = field(default_factory=list)


def _vllm_refused(case: dict) -> str | None:
    r = case.get("refused")
    if not r:
        return None
    return r["message"]


def compare(version: str, stem: str, case: dict) -> Verdict:
    refused = case.get("refused")
    if refused and (refused["stage"] == "oracle" or ENVIRONMENT_ERRORS.search(refused["message"])):
        return Verdict("skipped", details=[refused["message"][:120]])
    config = json.loads((CONFIGS / f"{stem}.json").read_text())
    gpu = catalog.gpu(case["gpu"])
    mem = case["kv_cache_memory_bytes"]
    s = Settings(tp=case["tp"], max_model_len=case["max_model_len"], kv_cache_dtype=case["kv_cache_dtype"],
                 vllm_version=version, kv_bytes=mem)
    try:
        model = parse_hf_config(config, name=stem)
        r = resolve(model, s, gpu)
    except (SpecError, ModelConfigError) as e:
        if refused:
            return Verdict("exact", details=[f"both refuse: {e}"])
        return Verdict("conservative", 0.0, [f"vllmfit refuses ({e}); vLLM starts"])
    lay = r.layout
    length = s.max_model_len or model.max_model_len
    resolved = case.get("resolved") or {}
    plan = case.get("plan") or {}
    details: list[str] = []
    if resolved.get("max_model_len") is not None and resolved["max_model_len"] != length:
        details.append(f"max_model_len {length} != vLLM {resolved['max_model_len']}")
        if length > resolved["max_model_len"]:
            return Verdict("over", details=details)
    if resolved.get("max_num_batched_tokens") not in (None, r.batched_tokens):
        details.append(f"max_num_batched_tokens {r.batched_tokens} != vLLM {resolved['max_num_batched_tokens']}")
    if resolved.get("max_num_seqs") not in (None, r.max_num_seqs):
        details.append(f"max_num_seqs {r.max_num_seqs} != vLLM {resolved['max_num_seqs']}")
    need_one = lay.bytes_for(length, 1, r.batched_tokens, s.pp)
    fits = need_one <= mem
    if refused:
        if refused["stage"] == "kv" and not fits:
            return Verdict("exact" if not details else "differs", details=details + ["both refuse: KV too small"])
        return Verdict("over", details=details + [f"vLLM refuses ({refused['stage']}): {refused['message'][:160]}"])
    tokens_v = plan.get("kv_tokens", 0)
    if not fits:
        return Verdict("conservative", 0.0, details + [f"vllmfit refuses: one request needs {need_one} > {mem}"])
    tokens_f = lay.tokens(mem, length, r.batched_tokens, s.pp)[0]
    blocks_f = lay.num_blocks(mem)
    if plan.get("num_blocks") and plan.get("tensor_bytes"):
        per_block_v = plan["tensor_bytes"] // plan["num_blocks"]
        if per_block_v != lay.block_bytes:
            details.append(f"block bytes {lay.block_bytes} != vLLM {per_block_v}")
    if plan.get("num_blocks") is not None and blocks_f != plan["num_blocks"]:
        details.append(f"blocks {blocks_f} != vLLM {plan['num_blocks']}")
    if len(plan.get("groups", [])) != lay.groups:
        details.append(f"groups {lay.groups} != vLLM {len(plan.get('groups', []))}")
    ratio = tokens_f / tokens_v if tokens_v else (1.0 if not tokens_f else float("inf"))
    if tokens_f > tokens_v:
        return Verdict("over", ratio, details + [f"KV tokens {tokens_f} > vLLM {tokens_v}"])
    if tokens_f < tokens_v:
        return Verdict("conservative", ratio, details + [f"KV tokens {tokens_f} < vLLM {tokens_v}"])
    return Verdict("exact" if not details else "differs", 1.0, details)


def _cases():
    for path in FIXTURES:
        data = json.loads(path.read_text())
        version = data["vllm_version"]
        for stem, cases in sorted(data["models"].items()):
            if not isinstance(cases, list) or not (CONFIGS / f"{stem}.json").exists():
                continue
            for i, case in enumerate(cases):
                yield version, stem, i, case


CASES = list(_cases())


def _id(c) -> str:
    version, stem, i, _ = c
    return f"{version}-{stem}-{i}"


def _field_key(detail: str) -> str:
    return detail.split(" ")[0]


@pytest.mark.skipif(not FIXTURES, reason="no oracle fixture")
@pytest.mark.parametrize("c", CASES, ids=[_id(c) for c in CASES])
def test_vllmfit_agrees_with_vllm(c):
    version, stem, _, case = c
    v = compare(version, stem, case)
    if v.kind in ("exact", "skipped"):
        return
    assert v.kind != "over", f"{stem} over-promises against vLLM {version}: {v.details}"
    if v.kind == "conservative":
        bound = [b for (m, what), (b, _) in CONSERVATIVE.items() if m == stem]
        assert bound, f"{stem}: unlisted conservative difference against vLLM {version}: {v.details}"
        assert v.ratio >= min(bound), f"{stem}: ratio {v.ratio:.3f} below the listed bound {min(bound)}: {v.details}"
    else:
        unlisted = [d for d in v.details if (stem, _field_key(d)) not in KNOWN_DIFFERENCES]
        assert not unlisted, f"{stem}: unlisted difference against vLLM {version}: {unlisted}"


def test_fixtures_cover_three_versions_and_every_config():
    versions = {json.loads(p.read_text())["vllm_version"] for p in FIXTURES}
    assert len(versions) >= 1, versions
    for p in FIXTURES:
        models = json.loads(p.read_text())["models"]
        assert {c.stem for c in CONFIGS.glob("*.json")} <= set(models), p.name


def agreement() -> dict[str, dict]:
    table: dict[str, dict] = {}
    for version, stem, _, case in CASES:
        v = compare(version, stem, case)
        row = table.setdefault(version, {"cases": 0, "exact": 0, "conservative": 0, "worst": 1.0, "over": 0,
                                         "differs": 0, "skipped": 0, "over_models": set(), "cons_models": set()})
        row["cases"] += 1
        row[v.kind] += 1
        if v.kind == "conservative":
            row["worst"] = min(row["worst"], v.ratio)
            row["cons_models"].add(stem)
        if v.kind == "over":
            row["over_models"].add(stem)
    return table


if __name__ == "__main__":
    for version, row in sorted(agreement().items()):
        print(f"vLLM {version}: {row['cases']} cases, {row['exact']} exact, {row['conservative']} conservative "
              f"(worst ratio {row['worst']:.3f}), {row['over']} over-promising, {row['differs']} other "
              f"differences, {row['skipped']} not runnable on CPU")
        print("  over:", sorted(row["over_models"]))
        print("  conservative:", sorted(row["cons_models"]))
