"""Decisions pinned byte for byte: `vllmfit plan -o json` of examples/cluster.yaml and of a seeded
synthetic cluster (benchmarks/plan_scale.py's generator, 40 nodes x 8 GPUs, 200 deployments, then
a few specs that fit nowhere, with their grouped reasons and checked fixes).

A change that only makes placement faster must leave these files alone. A change that means to
move a decision or a message regenerates them on purpose (`python tests/placement/test_placement_golden.py`)
and says why in its commit.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from vllmfit.core import placement
from vllmfit.core.spec.api import VLLMDeploymentSpec
from vllmfit.sources import catalog

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "plan"
REFUSED = [  # (name, spec): specs that fit nowhere on the synthetic cluster, each for another reason
    ("405b", {"model": "meta-llama/Llama-3.1-405B-Instruct", "maxModelLen": 8192}),
    ("70b-128k", {"model": "meta-llama/Llama-3.1-70B-Instruct", "maxModelLen": 131072, "maxNumSeqs": 64}),
    ("tp16", {"model": "meta-llama/Llama-3.1-70B-Instruct", "tensorParallelSize": 16}),
    ("pool", {"model": "meta-llama/Llama-3.1-70B-Instruct", "maxModelLen": 65536,
              "placement": {"nodeSelector": {"pool": "medium"}}}),
    ("replicas", {"model": "Qwen/Qwen2.5-32B-Instruct", "tensorParallelSize": 2, "maxModelLen": 32768,
                  "replicas": 200}),
    ("pinned", {"model": "meta-llama/Llama-3.1-70B-Instruct", "maxModelLen": 32768,
                "placement": {"nodeName": "node-0007", "allowReschedule": False}}),
]


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("plan_scale", ROOT / "benchmarks" / "plan_scale.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def synthetic() -> str:
    bench = _bench()
    nodes = bench.cluster(40, random.Random(1))
    p = placement.plan(nodes, bench.requests(200, 40, random.Random(2)))
    refused = {}
    for name, spec in REFUSED:
        req = placement.Request(f"x/{name}", VLLMDeploymentSpec.model_validate(spec), catalog.model(spec["model"]))
        d = placement.decide(p.ledger, req)
        refused[name] = {"phase": d.phase, "message": d.message, "reasons": list(d.reasons),
                         "suggestions": list(d.suggestions)}
    return placement.to_json(p) + "\n" + json.dumps(refused, indent=2) + "\n"


def example() -> str:
    from vllmfit.cli import plan as plan_cli

    objs = plan_cli.read_objects(plan_cli.read_files([str(ROOT / "examples" / "cluster.yaml")]))
    return placement.to_json(plan_cli.build_plan(objs)) + "\n"


CASES = {"synthetic": synthetic, "example-cluster": example}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_json_unchanged(name: str) -> None:
    assert CASES[name]() == (GOLDEN / f"{name}.json").read_text()


if __name__ == "__main__":  # regenerate: python tests/placement/test_placement_golden.py
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name, make in CASES.items():
        (GOLDEN / f"{name}.json").write_text(make())
        print(name, file=sys.stderr)
