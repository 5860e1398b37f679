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
    base, per_d, per_n = 118 * MIB, 96 * 1024, 16 * 1024  # the measured line (core.defaults)
    assert capacity.needed_bytes(0, 0) == base
    assert capacity.needed_bytes(5_000, 1_000) == base + 5_000 * per_d + 1_000 * per_n == 631_635_968
    assert capacity.needed_bytes(40_000, 10_000) == base + 40_000 * per_d + 10_000 * per_n


def test_the_charts_default_limit_holds_the_supported_size_with_its_headroom() -> None:
    values = yaml.safe_load(CHART.read_text())
    limit = parse_bytes(values["operator"]["resources"]["limits"]["memory"])
    assert limit >= 1.25 * capacity.needed_bytes(*SUPPORTED)  # 789,544,960 B <= 1Gi
    assert capacity.advice(*SUPPORTED, limit) is None
    assert defaults.OPERATOR_MEMORY_HEADROOM_PERCENT == 125


def test_advice_names_the_limit_and_what_to_set() -> None:
    # 10,000 on 2,000 need 118 MiB + 10,000 x 96 KiB + 2,000 x 16 KiB = 1,139,539,968 B (1,086.75 MiB);
    # x 1.25 = 1,358.4 MiB > 1Gi: set 1536Mi (the next multiple of 256 MiB)
    line = capacity.advice(10_000, 2_000, 1024 * MIB)
    assert line is not None
    assert "1Gi" in line and "10,000 VLLMDeployments on 2,000 GPU nodes" in line
    assert "about 1087Mi" in line and "operator.resources.limits.memory to 1536Mi" in line
    assert capacity.suggested_limit_bytes(10_000, 2_000) == 1536 * MIB
    # 5,000 on 1,000: 631,635,968 B x 1.25 = 789,544,960 B (753.0 MiB) -> 768 MiB
    assert capacity.suggested_limit_bytes(5_000, 1_000) == 768 * MIB
    assert capacity.advice(5_000, 1_000, 512 * MIB) is not None
    # 40,000 on 10,000: (118 MiB + 40,000 x 96 KiB + 10,000 x 16 KiB) x 1.25 = 5,030.4 MiB -> 5,120 MiB (20 x 256)
    assert capacity.suggested_limit_bytes(40_000, 10_000) == 20 * 256 * MIB
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

    store = Store(Options(memory_limit_bytes=1024 * MIB))
    store.cache.records = Many()
    store.books.ledger.nodes = dict.fromkeys((f"n{i}" for i in range(2_000)), None)
    with caplog.at_level(logging.WARNING):
        startup.say_memory(store)
    assert any("memory limit 1Gi is too small for 10,000 VLLMDeployments on 2,000 GPU nodes" in r.message
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
    assert m["vllmfit_operator_memory_needed_bytes"] == 118 * MIB + 96 * 1024 + 16 * 1024  # 1 deployment, 1 node


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
