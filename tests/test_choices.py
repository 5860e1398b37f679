"""The cluster-wide choices the operator and the CLI both take as flags (vllmfit.core.choices):
parsed by one function, so `vllmfit operator`, `vllmfit plan` and `vllmfit estimate` read the same
flags into the same values and refuse bad ones with the same line."""

from __future__ import annotations

import argparse

import pytest

from vllmfit.core import choices, limits, memory
from vllmfit.core.errors import UserError
from vllmfit.core.spec import validate
from vllmfit.main import build_parser

SHELLS = {"operator": [], "plan": ["-f", "x.yaml"], "estimate": ["--model", "Qwen/Qwen2.5-7B-Instruct"]}


def parsed(shell: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([shell, *SHELLS[shell], *flags])


@pytest.mark.parametrize("shell", SHELLS)
def test_every_shell_reads_the_kv_grant_flags_into_the_same_grant(shell: str) -> None:
    args = parsed(shell, "--default-kv-grant", "room", "--default-kv-requests", "2")
    assert choices.kv_grant_from_args(args) == memory.KvGrant("room", 2)
    assert choices.kv_grant_from_args(parsed(shell)) == memory.DEFAULT_KV_GRANT
    with pytest.raises(UserError) as e:
        choices.kv_grant_from_args(parsed(shell, "--default-kv-requests", "0"))
    assert str(e.value) == f"--default-kv-requests 0 must be in [1, {limits.MAX_KV_GRANT_REQUESTS}]"
    assert choices.kv_grant_from_args(parsed(shell, "--kv-tenants-per-gpu", "4")) == memory.KvGrant(tenants=4)
    with pytest.raises(UserError) as e:
        choices.kv_grant_from_args(parsed(shell, "--kv-tenants-per-gpu", "0"))
    assert str(e.value) == f"--kv-tenants-per-gpu 0 must be in [1, {limits.MAX_KV_TENANTS}]"


@pytest.mark.parametrize("shell", ["operator", "plan"])
def test_the_operator_and_plan_read_the_tenancy_flags_into_the_same_policy(shell: str) -> None:
    args = parsed(shell, "--pod-security-level", "baseline", "--allow-host-path", "/data/models",
                  "--allow-csi-driver", "secrets-store.csi.k8s.io")
    assert choices.tenancy_from_args(args) == validate.Policy("baseline", ("/data/models",),
                                                               ("secrets-store.csi.k8s.io",))
    assert choices.tenancy_from_args(parsed(shell)) == validate.DEFAULT_POLICY


def test_the_operator_takes_its_defaults_from_its_environment_and_says_so() -> None:
    p = argparse.ArgumentParser()
    choices.add_kv_grant_arguments(p, {choices.ENV_KV_GRANT: "room", choices.ENV_KV_REQUESTS: "3",
                                       choices.ENV_KV_TENANTS: "4"})
    choices.add_tenancy_arguments(p, {choices.ENV_POD_SECURITY_LEVEL: "privileged"})
    args = p.parse_args([])
    assert choices.kv_grant_from_args(args) == memory.KvGrant("room", 3, 4)
    with pytest.raises(UserError, match="--pod-security-level 'privileged' must be one of baseline, restricted"):
        choices.tenancy_from_args(args)  # an environment default argparse never checks
    assert "default: $VLLMFIT_DEFAULT_KV_GRANT or requests" in " ".join(p.format_help().split())
