"""The budget policy (what vllmfit hands out of each GPU) as `estimate` and `plan` take it: one
parser, so the two subcommands cannot word it differently. The default KV grant and what a
tenant's podTemplate may reach are the operator's flags too, so their parsers are the core's
(`vllmfit.core.choices`), which the operator calls as well."""

from __future__ import annotations

import argparse

from vllmfit.core import defaults, memory
from vllmfit.core.errors import UserError


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
