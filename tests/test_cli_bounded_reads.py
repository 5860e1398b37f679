"""Every CLI input is read bounded (issue 22 item 7): `vllmfit plan -f /dev/zero` used to read
forever. A device, a FIFO with an endless writer, stdin, a huge sparse file and a symbolic link to
/dev/zero in a model directory each end with one line on stderr and exit 2.

The tests that could read forever if the bound broke run the CLI in a child process with a
timeout and an address-space limit, so a regression fails instead of hanging the suite."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllmfit import main as cli
from vllmfit.cli import inputs
from vllmfit.core import limits

LIMIT = 256 * 1024 * 1024  # limits.MAX_INPUT_BYTES, by hand
QWEN = Path(__file__).parent / "data" / "hf-configs" / "Qwen__Qwen2.5-7B.json"
TIMEOUT_S = 120  # a run that reads past the bound would go on until the timeout


def test_the_bound_is_named_once_in_limits() -> None:
    assert limits.MAX_INPUT_BYTES == LIMIT == 268435456


def _address_space_limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _vllmfit(*args: str, stdin: object = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    """`vllmfit ARGS` in a child process that cannot hang the suite nor take the machine's memory."""
    try:
        return subprocess.run([sys.executable, "-m", "vllmfit", *args], check=False, stdin=stdin,
                              capture_output=True, text=True, timeout=TIMEOUT_S,
                              preexec_fn=_address_space_limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllmfit {' '.join(args)} still reading after {TIMEOUT_S} s: the input is not bounded")


def _one_line_exit_2(run: subprocess.CompletedProcess[str], name: str) -> None:
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.count("\n") == 1, run.stderr[-2000:]
    assert run.stderr.startswith(f"vllmfit: error: cannot read {name}: larger than 268435456 bytes")
    assert run.stdout == ""


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_plan_of_dev_zero_stops_at_the_bound() -> None:
    _one_line_exit_2(_vllmfit("plan", "-f", "/dev/zero"), "/dev/zero")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_plan_of_stdin_that_never_ends_stops_at_the_bound() -> None:
    with open("/dev/zero", "rb") as zero:
        _one_line_exit_2(_vllmfit("plan", "-f", "-", stdin=zero), "<stdin>")


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not shutil.which("yes"), reason="no FIFOs")
def test_plan_of_a_fifo_with_an_endless_writer_stops_at_the_bound(tmp_path: Path) -> None:
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    # `yes` writes valid YAML lines ("a: b") for ever; it dies of SIGPIPE when the reader goes.
    writer = subprocess.Popen(["sh", "-c", f"exec yes 'a: b' > '{fifo}'"])
    try:
        _one_line_exit_2(_vllmfit("plan", "-f", str(fifo)), str(fifo))
    finally:
        writer.kill()
        writer.wait(timeout=10)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_plan_reads_a_fifo_that_ends(tmp_path: Path) -> None:
    """A FIFO (or `<(kubectl get ...)`) that ends is read like a file."""
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    text = yaml.safe_dump({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}})
    writer = subprocess.Popen(["sh", "-c", f"printf '%s' \"$0\" > '{fifo}'", text])
    try:
        run = _vllmfit("plan", "-f", str(fifo))
    finally:
        writer.kill()
        writer.wait(timeout=10)
    # read to the end and parsed: a Pod is not something to plan
    assert run.returncode == 2 and "nothing to plan" in run.stderr, run.stderr


def test_a_huge_sparse_file_is_refused_from_its_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as f:
        try:
            f.truncate(1 << 40)  # 1 TiB, sparse: no block is written
        except OSError:
            f.truncate(LIMIT + 1)
    assert cli.main(["plan", "-f", str(huge)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"vllmfit: error: cannot read {huge}: larger than 268435456 bytes")


def test_one_byte_past_the_bound_is_refused_and_the_bound_itself_is_read(tmp_path: Path) -> None:
    f = tmp_path / "f.yaml"
    f.write_bytes(b"a" * 1000)
    assert inputs.read_input(f, limit=1000) == "a" * 1000
    with pytest.raises(cli.UserError, match=r"^cannot read .*f\.yaml: larger than 999 bytes"):
        inputs.read_input(f, limit=999)


def test_a_stream_one_byte_past_the_bound_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x" * (3 * inputs.CHUNK + 1))))
    with pytest.raises(cli.UserError, match=r"^cannot read <stdin>: larger than 3145728 bytes"):
        inputs.read_input("-", limit=3 * inputs.CHUNK)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x" * (3 * inputs.CHUNK))))
    assert len(inputs.read_input("-", limit=3 * inputs.CHUNK)) == 3 * inputs.CHUNK


def test_text_that_is_not_utf8_and_a_directory_are_one_line_errors(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"kind: Node\n\xff\n")
    assert cli.main(["plan", "-f", str(bad)]) == 2
    assert capsys.readouterr().err == f"vllmfit: error: cannot read {bad}: not UTF-8 text (byte 11 is 0xff); " \
                                      "pass a YAML or JSON file\n"
    assert cli.main(["plan", "-f", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"vllmfit: error: cannot read {tmp_path}: Is a directory\n"


def test_crlf_line_ends_read_as_before(tmp_path: Path) -> None:
    f = tmp_path / "win.yaml"
    f.write_bytes(b"a: 1\r\nb: 2\r\n")
    assert inputs.read_input(f) == "a: 1\nb: 2\n"


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_estimate_model_config_of_dev_zero_stops_at_the_bound() -> None:
    _one_line_exit_2(_vllmfit("estimate", "--model-config", "/dev/zero", "--gpu", "H100"), "/dev/zero")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_estimate_safetensors_index_linked_to_dev_zero_stops_at_the_bound(tmp_path: Path) -> None:
    shutil.copy(QWEN, tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").symlink_to("/dev/zero")
    index = tmp_path / "model.safetensors.index.json"
    _one_line_exit_2(_vllmfit("estimate", "--model-config", str(tmp_path), "--gpu", "H100"), str(index))
