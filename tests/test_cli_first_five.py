"""What a newcomer meets in the first five minutes: input errors on stderr with the field's path
and the nearest field; no network without --hub (checked with sockets disabled), and close catalog
names or none for an unknown model; a file written says where, and what the exit code means."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from vllmfit import main as cli

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = str(ROOT / "examples" / "cluster.yaml")  # the nodes (and deployments) every plan here is beside


def dep(name: str, spec: str) -> str:
    return f"apiVersion: vllmfit.dev/v1alpha1\nkind: VLLMDeployment\nmetadata: {{name: {name}}}\nspec: {spec}\n"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every socket refused, and each attempt recorded."""
    tried: list[object] = []

    def refuse(*args: object, **kwargs: object) -> object:
        tried.append(args)
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return tried


def test_a_misspelt_field_is_named_with_the_field_it_is_near(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(dep("typo", "{model: llama-3.1-8b, maxModelLength: 8192}"))
    code, out, err = run(capsys, "plan", "-f", CLUSTER, "-f", str(f))
    assert code == 2
    assert err.splitlines() == [(f"vllmfit plan: error: VLLMDeployment default/typo ({f} document 1): "
                                "spec.maxModelLength: unknown field; did you mean maxModelLen?")]
    assert "maxModelLength" not in out and "error:" not in out


def test_a_field_with_nothing_near_is_named_unknown_alone(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(dep("typo", "{model: llama-3.1-8b, kvCache: {tokn: 3}, zzzzzz: 1}"))
    code, _, err = run(capsys, "plan", "-f", CLUSTER, "-f", str(f))
    assert code == 2 and len(err.splitlines()) == 1
    assert "spec.kvCache.tokn: unknown field; did you mean tokens?; 1 more: spec.zzzzzz" in err


def test_plan_never_reaches_the_network_without_hub(no_network: list[object], capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(dep("x", "{model: acme/NotARealModel-7B}"))
    code, out, err = run(capsys, "plan", "-f", CLUSTER, "-f", str(f))
    assert no_network == []
    assert code == 2 and out.splitlines()[0].endswith("; 1 input error (on stderr)")
    [line] = err.splitlines()
    assert "unknown model 'acme/NotARealModel-7B' (list them" in line  # no unrelated "closest" names
    assert "closest" not in line and "pass --hub" in line


def test_estimate_never_reaches_the_network_without_hub(no_network: list[object],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "estimate", "--model", "acme/NotARealModel-7B")
    assert no_network == [] and code == 2 and out == ""
    assert "closest" not in err and "pass --hub" in err and "--model-config PATH" in err
    code, _, err = run(capsys, "estimate", "--model", "mistralai/Mistral-7B-Instruct-v0.4")
    assert no_network == [] and code == 2
    assert "closest: " in err and "mistralai/Mistral-7B-Instruct-v0.3" in err


def test_with_hub_the_hub_is_asked(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vllmfit.sources import hub

    asked: list[str] = []

    def offline(name: str, token: str | None = None) -> None:
        asked.append(name)
        raise hub.HubError(f"{name} not found on the Hugging Face Hub; check spec.model or set spec.modelConfig")

    monkeypatch.setattr(hub, "resolve_model", offline)
    code, _, err = run(capsys, "estimate", "--model", "acme/NotARealModel-7B", "--hub")
    assert code == 2 and asked == ["acme/NotARealModel-7B"] and "check --model" in err


@pytest.mark.parametrize("output", ["table", "json", "html", "svg"])
def test_writing_a_file_says_where_and_what_the_exit_code_means(output: str, capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    out_file = tmp_path / f"plan.{output}"
    code, out, err = run(capsys, "plan", "-f", str(ROOT / "examples" / "cluster.yaml"), "-o", output,
                         "--out-file", str(out_file))
    assert code == 1 and out == "" and out_file.stat().st_size > 0
    assert err == f"wrote plan to {out_file}: something does not fit (exit 1)\n"
    code, out, err = run(capsys, "plan", "-f", str(ROOT / "examples" / "sharing" / "six-small.yaml"), "-o", output,
                         "--out-file", str(out_file))
    assert code == 0 and err == f"wrote plan to {out_file}: every deployment fits\n"
