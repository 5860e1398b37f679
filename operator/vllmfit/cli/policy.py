"""The cluster-wide choices that `estimate` and `plan` take, as the operator's flags take them:
the budget policy (what vllmfit hands out of each GPU), the default KV grant (a spec without
kvCache or maxNumSeqs) and, for `plan`, what a tenant's podTemplate may reach. One parser each, so the two subcommands cannot word them differently."""

from __future__ import annotations

import argparse

from vllmfit.core import defaults, memory
from vllmfit.core.errors import UserError
from vllmfit.core.spec import validate


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """The budget policy flags (also `plan`)."""
    b = p.add_argument_group("budget policy (what vllmfit hands out of each GPU; docs/glossary.md)")
    b.add_argument("--budget-policy", choices=list(memory.POLICIES), metavar="NAME",
                   help=f"a named policy: counted (default: {memory.DEFAULT_POLICY.formula}, what one vLLM at "
                        f"--gpu-memory-utilization {defaults.UTILIZATION} uses on an empty GPU; the overheads are "
                        f"booked in each footprint) or adr-0002 ({memory.ADR_POLICY.formula}; the default "
                        "with --policy adr)")
    b.add_argument("--budget-utilization", type=float, metavar="U",
                   help=f"the vLLM utilization one server may use, in [0, 1] (default {defaults.UTILIZATION})")
    b.add_argument("--budget-reserve", metavar="QTY",
                   help="bytes held back on each GPU besides (1 - U), a Kubernetes quantity "
                        f"(default 0; adr-0002: {defaults.RESERVE_BYTES // defaults.GIB}Gi)")


def budget_from_args(args: argparse.Namespace) -> memory.BudgetPolicy:
    """--budget-policy / --budget-utilization / --budget-reserve -> the policy (one-line error, exit 2,
    when invalid). Neither set: the memory policy's default (`counted`; `adr-0002` with --policy adr)."""
    from vllmfit.core.quantity import parse_bytes

    named = getattr(args, "budget_policy", None)
    base = memory.policy_named(named) if named else memory.default_policy(getattr(args, "policy", "vllm"))
    u = base.utilization if args.budget_utilization is None else args.budget_utilization
    try:
        reserve = base.reserve_bytes if args.budget_reserve is None else parse_bytes(args.budget_reserve, "--budget-reserve")
    except ValueError as e:
        raise UserError(str(e)) from None
    chosen = named or args.budget_utilization is not None or args.budget_reserve is not None
    policy = base.with_utilization(u, reserve, "CLI" if chosen else "default")
    bad = policy.error()
    if bad:
        raise UserError(bad.replace("budget utilization", "--budget-utilization").replace("budget reserve", "--budget-reserve"))
    return policy


def add_kv_grant_args(p: argparse.ArgumentParser) -> None:
    """The cluster's default KV grant (also `plan`; the operator's --default-kv-grant)."""
    g = p.add_argument_group("default KV grant (a spec without kvCache or maxNumSeqs)")
    g.add_argument("--default-kv-grant", choices=defaults.KV_GRANT_RULES, default=defaults.DEFAULT_KV_GRANT,
                   help="requests: --default-kv-requests requests of the full context, clamped to the room left "
                        "(default); room: vLLM's own, the room left, at most vLLM's default max-num-seqs x max-model-len")
    g.add_argument("--default-kv-requests", type=int, metavar="N", default=defaults.DEFAULT_KV_GRANT_REQUESTS,
                   help="full-length requests the requests rule grants (default %(default)s)")


def kv_grant_from_args(args: argparse.Namespace) -> memory.KvGrant:
    """--default-kv-grant / --default-kv-requests -> the default grant (one-line error, exit 2, when invalid)."""
    grant = memory.KvGrant(getattr(args, "default_kv_grant", defaults.DEFAULT_KV_GRANT),
                           getattr(args, "default_kv_requests", defaults.DEFAULT_KV_GRANT_REQUESTS))
    bad = grant.error()
    if bad:
        raise UserError(bad.replace("default KV grant requests", "--default-kv-requests"))
    return grant


def add_tenancy_args(p: argparse.ArgumentParser) -> None:
    """What a podTemplate may reach (`plan`; the operator's flags of the same names, chart `tenants.*`),
    so that `plan` refuses exactly what the cluster's webhook and operator refuse."""
    g = p.add_argument_group("tenants (docs/webhook.md, \"What a tenant may write\")")
    g.add_argument("--pod-security-level", choices=("baseline", "restricted"), default=validate.DEFAULT_POLICY.level,
                   help="the Pod Security level no podTemplate may go beyond (default %(default)s)")
    g.add_argument("--allow-host-path", action="append", default=[], metavar="PATH",
                   help="a host path a podTemplate's hostPath volume may mount (it or below it; repeatable; default none)")
    g.add_argument("--allow-csi-driver", action="append", default=[], metavar="DRIVER",
                   help="a CSI driver a podTemplate's inline csi volume may use (repeatable; default none)")


def tenancy_from_args(args: argparse.Namespace) -> validate.Policy:
    return validate.Policy(level=getattr(args, "pod_security_level", validate.DEFAULT_POLICY.level),
                           host_paths=tuple(getattr(args, "allow_host_path", ()) or ()),
                           csi_drivers=tuple(getattr(args, "allow_csi_driver", ()) or ()))
