"""`vllmfit calibration --from-log LOG` writes the record `--calibration` reads, from a real vLLM
start-up log (examples/calibration: the memory lines of two public vLLM 0.19.0 logs), and
`estimate --calibration` books what the log says the server used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vllmfit import main as cli

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "examples" / "calibration"
GIB = 2**30
GPT_OSS = ["--model", "openai/gpt-oss-20b", "--tp", "2", "--max-model-len", "8192", "--gpu-memory-utilization", "0.9",
           "--vllm-version", "0.19"]
CODELLAMA = ["--model", "codellama/CodeLlama-7b-hf", "--max-model-len", "8192", "--gpu-memory-utilization", "0.95",
             "--vllm-version", "0.19"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def predicted(capsys: pytest.CaptureFixture[str], flags: list[str]) -> int:
    code, out, _ = run(capsys, "estimate", *flags, "-o", "json")
    assert code in (0, 1)
    return int(json.loads(out)["per_gpu"]["total_bytes"])


@pytest.mark.parametrize(("log", "flags", "figures"), [
    # the log's lines, by hand: Total non KV cache memory + Available KV cache memory + Graph capturing
    # took + the start-up snapshot's non_torch_memory (the CUDA context); Model loading took
    ("gpt-oss-20b-h100-tp2-len8192.log", GPT_OSS, (11.95, 59.32, 1.55, 1.99, 7.01)),
    ("codellama-7b-h100-tp1-len8192.log", CODELLAMA, (13.57, 61.66, 0.89, 0.51, 12.56)),
])
def test_a_record_from_a_log_holds_what_the_log_says_and_what_vllmfit_predicted(
        log: str, flags: list[str], figures: tuple[float, ...], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "calibration", "--from-log", str(LOGS / log), *flags)
    assert code == 0
    [rec] = yaml.safe_load(out)["records"]
    non_kv, kv, graphs, context, weights = (round(x * GIB) for x in figures)
    assert rec["observedBytes"] == non_kv + kv + graphs + context
    assert rec["observedKvCacheBytes"] == kv and rec["observedWeightsBytes"] == weights
    assert rec["predictedBytes"] == predicted(capsys, flags)
    assert rec["tp"] == int(flags[flags.index("--tp") + 1]) if "--tp" in flags else rec["tp"] == 1
    assert rec["vllmVersion"] == "0.19" and rec["gpu"] == "NVIDIA-H100-80GB-HBM3"
    assert err.startswith("the record: ")


def test_estimate_books_the_over_run_the_record_teaches(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "record.yaml"
    code, out, err = run(capsys, "calibration", "--from-log", str(LOGS / "gpt-oss-20b-h100-tp2-len8192.log"), *GPT_OSS,
                         "--out-file", str(out_file))
    assert code == 0 and out == ""
    assert err == f"wrote the record to {out_file}: used 0.4 GiB more than predicted: --calibration books it\n"
    [rec] = yaml.safe_load(out_file.read_text())["records"]
    before = predicted(capsys, GPT_OSS)
    code, out, _ = run(capsys, "estimate", *GPT_OSS, "--calibration", str(out_file), "-o", "json")
    fp = json.loads(out)["per_gpu"]
    assert fp["learned_bytes"] == rec["observedBytes"] - rec["predictedBytes"] > 0
    assert fp["total_bytes"] == before + fp["learned_bytes"] == rec["observedBytes"]
    code, out, _ = run(capsys, "estimate", *GPT_OSS, "--calibration", str(out_file))
    assert "learned over-run (--calibration)" in out
    code, out, _ = run(capsys, "estimate", *GPT_OSS[:-2], "--vllm-version", "0.33", "--calibration", str(out_file),
                       "-o", "json")
    assert json.loads(out)["per_gpu"].get("learned_bytes", 0) == 0  # another configuration: the record does not apply


def test_the_example_record_is_what_the_command_writes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "calibration", "--from-log", str(LOGS / "gpt-oss-20b-h100-tp2-len8192.log"), *GPT_OSS)
    assert code == 0 and out == (LOGS / "record.yaml").read_text()


def test_a_log_without_the_kv_line_is_one_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("INFO starting vLLM\n")
    code, out, err = run(capsys, "calibration", "--from-log", str(log), *GPT_OSS)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "no 'Available KV cache memory' line" in err


def test_a_model_outside_the_catalog_is_read_from_the_hub_when_asked(capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, a model the catalog does not know says "pass --hub"; the command takes --hub, as
    estimate does (it refused the flag it told the user to pass)."""
    from vllmfit.sources import hub

    log = str(LOGS / "codellama-7b-h100-tp1-len8192.log")
    code, _, err = run(capsys, "calibration", "--from-log", log, "--model", "acme/NotAModel-7B")
    assert code == 2 and "pass --hub" in err

    def no_such_repo(name: str, token: str | None = None, revision: str | None = None) -> None:
        raise hub.HubError(f"{name} was not found on the Hugging Face Hub")

    monkeypatch.setattr(hub, "resolve_model", no_such_repo)  # no network in tests: the Hub's answer, faked
    code, _, err = run(capsys, "calibration", "--from-log", log, "--model", "acme/NotAModel-7B", "--hub")
    assert code == 2 and "was not found on the Hugging Face Hub" in err and "unrecognized" not in err
