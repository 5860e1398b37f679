"""`vllmfit estimate --output json` on every VLLMDeployment in examples/ is pinned byte for byte.

The golden files were written by the code before the package was reorganised (issue 10); a change
that moves code must leave them alone. A change that means to move a number regenerates them on
purpose (`python tests/test_estimate_golden.py`) and says why in its commit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllmfit.cli.render.layout import SPEC_FLAGS

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "estimate"
FLAGS = SPEC_FLAGS  # spec field -> estimate flag: the CLI's own table
KV_FLAGS = {  # spec.kvCache field -> estimate flag
    "tokens": "--kv-cache-tokens",
    "memory": "--kv-cache-memory",
    "concurrency": "--kv-concurrency",
    "typicalLength": "--typical-length",
}

LORA_FLAGS = {  # spec.lora field -> estimate flag
    "maxLoras": "--lora-max-loras",
    "maxLoraRank": "--lora-max-rank",
    "loraDtype": "--lora-dtype",
}


def cases() -> dict[str, list[str]]:
    out = {}
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "VLLMDeployment":
                continue
            spec = doc["spec"]
            args = ["estimate", "--model", spec["model"], "--output", "json"]
            for field, flag in FLAGS.items():
                if spec.get(field) is not None:
                    args += [flag, str(spec[field])]
            for field, flag in KV_FLAGS.items():
                if (spec.get("kvCache") or {}).get(field) is not None:
                    args += [flag, str(spec["kvCache"][field])]
            if (spec.get("kvCache") or {}).get("grow"):
                args.append("--kv-grow")
            for field, flag in LORA_FLAGS.items():
                if (spec.get("lora") or {}).get(field) is not None:
                    args += [flag, str(spec["lora"][field])]
            out[f"{path.stem}-{doc['metadata']['name']}"] = args
    return out


@pytest.mark.parametrize("name", sorted(cases()))
def test_estimate_json_unchanged(name, capsys):
    from vllmfit import main as cli

    assert cli.main(cases()[name]) in (0, 1)
    assert capsys.readouterr().out == (GOLDEN / f"{name}.json").read_text()


if __name__ == "__main__":  # regenerate: python tests/test_estimate_golden.py
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name, args in cases().items():
        run = subprocess.run([sys.executable, "-m", "vllmfit", *args], check=False, capture_output=True, text=True)
        (GOLDEN / f"{name}.json").write_text(run.stdout)
        print(name, run.returncode)
