"""The operator's own memory: what the cluster it holds needs, against the limit the chart gives it.

The figures are the measured ones named in core.defaults (benchmarks/operator_scale.py; the table
in docs/install.md, "Sizing the operator"); each expectation here is computed by hand from them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from opkit import Cluster, Operator, node, vd
from prometheus_client import REGISTRY, generate_latest

from vllmfit import main as cli
from vllmfit.core import defaults
from vllmfit.core.errors import UserError
from vllmfit.core.quantity import parse_bytes
from vllmfit.operator import main
from vllmfit.operator.booking import own_memory as capacity
from vllmfit.operator.booking.state import Options, Store
from vllmfit.operator.handlers import startup

MIB = 1 << 20
CHART = Path(__file__).resolve().parents[2] / "charts" / "vllmfit" / "values.yaml"
SUPPORTED = (5_000, 1_000)  # the size docs/install.md documents for the chart's default limit


def test_needed_is_the_measured_line() -> None:
    base, per_d, per_n = 128 * MIB, 40 * 1024, 16 * 1024  # the measured line (core.defaults)
    assert capacity.needed_bytes(0, 0) == base
    assert capacity.needed_bytes(5_000, 1_000) == base + 5_000 * per_d + 1_000 * per_n == 355_401_728
    assert capacity.needed_bytes(40_000, 10_000) == base + 40_000 * per_d + 10_000 * per_n


def test_the_charts_default_limit_holds_the_supported_size_with_its_headroom() -> None:
    values = yaml.safe_load(CHART.read_text())
    limit = parse_bytes(values["operator"]["resources"]["limits"]["memory"])
    assert limit >= 1.25 * capacity.needed_bytes(*SUPPORTED)  # 444,252,160 B <= 1Gi
    assert capacity.advice(*SUPPORTED, limit) is None
    assert defaults.OPERATOR_MEMORY_HEADROOM_PERCENT == 125


def test_advice_names_the_limit_and_what_to_set() -> None:
    # 10,000 on 2,000 need 128 MiB + 10,000 x 40 KiB + 2,000 x 16 KiB = 576,585,728 B (549.9 MiB);
    # x 1.25 = 687.3 MiB > 512Mi: set 768Mi (the next multiple of 256 MiB)
    line = capacity.advice(10_000, 2_000, 512 * MIB)
    assert line is not None
    assert "512Mi" in line and "10,000 VLLMDeployments on 2,000 GPU nodes" in line
    assert "about 550Mi" in line and "operator.resources.limits.memory to 768Mi" in line
    assert capacity.suggested_limit_bytes(10_000, 2_000) == 768 * MIB
    assert capacity.advice(10_000, 2_000, 1024 * MIB) is None
    # 5,000 on 1,000: 355,401,728 B x 1.25 = 444,252,160 B (423.7 MiB) -> 512 MiB
    assert capacity.suggested_limit_bytes(5_000, 1_000) == 512 * MIB
    assert capacity.advice(5_000, 1_000, 384 * MIB) is not None
    # 40,000 on 10,000: (128 MiB + 40,000 x 40 KiB + 10,000 x 16 KiB) x 1.25 = 2,308.4 MiB -> 2,560 MiB (10 x 256)
    assert capacity.suggested_limit_bytes(40_000, 10_000) == 10 * 256 * MIB
    assert capacity.advice(5_000, 1_000, None) is None  # no limit: nothing to say
    assert capacity.advice(10, 2, 512 * MIB) is None


def test_the_operator_takes_its_limit_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    captured: dict[str, Any] = {}

    async def fake_operator(**kwargs: Any) -> None:
        captured.update(kwargs)

    import kopf

    monkeypatch.setattr(kopf, "operator", fake_operator)
    monkeypatch.setenv("VLLMFIT_MEMORY_LIMIT", "1073741824")  # the downward API gives bytes
    monkeypatch.setenv("POD_NAME", "vllmfit-operator-abc")
    assert cli.main(["operator", "--metrics-port", "0", "--health-port", "0", "--no-webhook"]) == 0
    options = captured["memo"]["store"].options
    assert (options.memory_limit_bytes, options.pod_name) == (1 << 30, "vllmfit-operator-abc")
    captured.clear()
    assert cli.main(["operator", "--metrics-port", "0", "--health-port", "0", "--no-webhook",
                     "--memory-limit", "512Mi"]) == 0
    assert captured["memo"]["store"].options.memory_limit_bytes == 512 * MIB
    args = main.argparse.Namespace(memory_limit="half a gig")
    with pytest.raises(UserError, match="--memory-limit 'half a gig' is not"):
        main.memory_limit(args)


def test_start_up_says_when_the_limit_is_too_small(caplog: pytest.LogCaptureFixture) -> None:
    class Many(dict):  # 10,000 records without building them: only their number is read
        def __len__(self) -> int:
            return 10_000

    store = Store(Options(memory_limit_bytes=512 * MIB))
    store.cache.records = Many()
    store.books.ledger.nodes = dict.fromkeys((f"n{i}" for i in range(2_000)), None)
    with caplog.at_level(logging.WARNING):
        startup.say_memory(store)
    assert any("memory limit 512Mi is too small for 10,000 VLLMDeployments on 2,000 GPU nodes" in r.message
               for r in caplog.records)
    caplog.clear()
    store.options.memory_limit_bytes = 2 << 30
    with caplog.at_level(logging.WARNING):
        startup.say_memory(store)
    assert not caplog.records


def samples() -> dict[str, float]:
    out = {}
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith("vllmfit_operator_memory_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_metrics_show_the_limit_and_the_need(cluster: Cluster, operator: Operator,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.store.options, "memory_limit_bytes", 1 << 30)
    await cluster.create(node("gpu-a", gpus=2))
    await cluster.create(vd("llama", "Qwen/Qwen2.5-7B-Instruct"))
    await cluster.phase("llama", "Admitted")
    m = samples()
    assert m["vllmfit_operator_memory_limit_bytes"] == 1 << 30
    assert m["vllmfit_operator_memory_needed_bytes"] == 128 * MIB + 40 * 1024 + 16 * 1024  # 1 deployment, 1 node


def test_the_install_docs_table_is_the_operators_own_line() -> None:
    """docs/install.md, "Sizing the operator": each row's "sizes itself for" and "limit to set" are
    what the operator computes (the measured column comes from benchmarks/operator_scale.py)."""
    from vllmfit.core.quantity import format_bytes

    text = (CHART.parents[2] / "docs" / "install.md").read_text()
    section = text.split("## Sizing the operator", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip(" *") for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 5
    for d, n, _measured, sized, limit in rows:
        deployments, nodes = int(d.replace(",", "")), int(n.replace(",", ""))
        assert sized == f"{capacity.needed_bytes(deployments, nodes) / MIB:,.0f} MiB"
        assert limit.split(" ")[0] == format_bytes(capacity.suggested_limit_bytes(deployments, nodes))
