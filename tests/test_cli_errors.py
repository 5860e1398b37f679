"""CLI errors a newcomer meets first are one line in the CLI's words (issue 24 item 4): a bad flag or
choice is not followed by the whole usage; `vllmfit status` on a cluster without the CRD says so in
a sentence instead of the client's "(404)"."""

from __future__ import annotations

import argparse

import pytest
from kubernetes.client import V1Node, V1NodeList, V1ObjectMeta
from kubernetes.client.exceptions import ApiException

from vllmfit import main as entry
from vllmfit.cli import status as statuscmd
from vllmfit.core.errors import UserError


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["estimate", "-m", "meta-llama/Llama-3.1-8B-Instruct", "--quantization", "fp9"],
         "vllmfit estimate: error: argument --quantization: invalid choice: 'fp9' (choose from 'fp8', "),
        (["plan", "-f", "x.yaml", "-o", "pdf"], "vllmfit plan: error: argument -o/--output: invalid choice: 'pdf'"),
        (["models", "-o", "yaml"], "vllmfit models: error: argument --output/-o: invalid choice: 'yaml'"),
        (["estimate", "--tp"], "vllmfit estimate: error: argument --tp: expected one argument"),
        (["nonsense"], "vllmfit: error: argument COMMAND: invalid choice: 'nonsense'"),
    ],
)
def test_a_bad_flag_or_choice_is_one_line_and_exit_2(argv: list[str], says: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        entry.main(argv)
    assert exit_.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err  # no "usage: vllmfit estimate [-h] (--model MODEL | ..." block
    assert lines[0].startswith(says), lines[0]
    assert lines[0].endswith(f"(see {says.split(': error')[0]} --help)")


class _Nodes:
    def list_node(self) -> V1NodeList:
        return V1NodeList(items=[V1Node(metadata=V1ObjectMeta(name="a"))])


class _NoCrd:
    def __init__(self, status: int, reason: str) -> None:
        self.status, self.reason = status, reason

    def list_cluster_custom_object(self, group: str, version: str, plural: str) -> dict:
        # what the kubernetes client raises: its text starts "(404)\nReason: Not Found\n..."
        raise ApiException(status=self.status, reason=self.reason)


ARGS = argparse.Namespace(kubeconfig=None, context=None, output="table", out_file=None)


def test_status_without_the_crd_says_so_in_a_sentence() -> None:
    assert str(ApiException(status=404, reason="Not Found")).startswith("(404)")  # what was printed before
    with pytest.raises(UserError) as err:
        statuscmd.run_status(ARGS, _Nodes(), _NoCrd(404, "Not Found"))
    msg = str(err.value)
    assert "(404)" not in msg and "\n" not in msg
    assert "vllmdeployments.vllmfit.dev" in msg and "not installed" in msg
    assert "helm install" in msg or "kubectl apply" in msg


@pytest.mark.parametrize(("status", "reason", "words"), [
    (403, "Forbidden", "may not list"), (401, "Unauthorized", "credentials"), (500, "Internal Server Error", "500")])
def test_status_api_refusals_are_sentences(status: int, reason: str, words: str) -> None:
    with pytest.raises(UserError) as err:
        statuscmd.run_status(ARGS, _Nodes(), _NoCrd(status, reason))
    msg = str(err.value)
    assert not msg.split(": ", 1)[1].startswith("("), msg
    assert words in msg and "\n" not in msg


# --- issue 31: suggestions by prefix and memory; the CLI's own words ----------------------------------


def test_a_gpu_prefix_suggests_every_gpu_it_starts_largest_first(capsys: pytest.CaptureFixture[str]) -> None:
    code = entry.main(["estimate", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "NVIDIA-H100"])
    err = capsys.readouterr().err
    assert code == 2 and "\n" not in err.strip()
    closest = err.split("closest: ", 1)[1].split(" (list them")[0].split(", ")
    assert set(closest) == {"NVIDIA-H100-NVL", "NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"}  # not an A10
    assert closest[0] == "NVIDIA-H100-NVL"  # 94 GB before the 80 GB models


def test_the_hubs_errors_speak_the_clis_words(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vllmfit.sources import hub

    def offline(name: str, token: str | None = None) -> None:
        raise hub.HubError(f"cannot reach the Hugging Face Hub at https://huggingface.co for {name} (no network); "
                           "will retry; set spec.modelConfig to avoid the Hub", transient=True)

    monkeypatch.setattr(hub, "resolve_model", offline)
    assert entry.main(["estimate", "--model", "org/not-in-the-catalog"]) == 2
    err = capsys.readouterr().err
    assert "will retry" not in err and "spec.modelConfig" not in err and "--model-config PATH" in err
