"""`vllmfit plan` (offline, from exported or hand-written YAML; the documents are read by `documents`;
the Hugging Face Hub only with --hub).

plan: every document is read on its own; a bad one (malformed YAML, an object without a kind, a
node without GPU information, a deployment naming a missing model) becomes one line in
Plan.errors and the rest is still planned; a Kubernetes object of a kind plan does not use (a
PersistentVolumeClaim, a Service) is ignored with a note in Plan.warnings. Exit code (`exit_code`,
as `estimate` and kubectl): 0 when every deployment is admitted, 1 when any is not, 2 when any
input is in error (every error listed, one line each; the rest is still planned and shown) or
nothing can be planned (no GPU node for the deployments). A reader that leaves early
(`plan | head`) is a normal end: the exit code is still the verdict. Deployments whose status says Admitted/Running
with status.memory keep those bookings (never moved); all others are decided in creation order,
those without creationTimestamp after them, in input order.

`vllmfit status` (the `status` module) draws the same pictures from the live cluster's status fields.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from vllmfit.cli import inputs, output, render
from vllmfit.cli.documents import Objects, read_files, read_objects
from vllmfit.cli.output import console, hub_words, write_then
from vllmfit.core import choices, memory, placement
from vllmfit.core.errors import UserError
from vllmfit.core.model.facts import ModelArch
from vllmfit.core.spec import read, validate
from vllmfit.core.spec.api import KIND, VLLMDeployment
from vllmfit.sources import catalog, resolve

OUTPUTS = ("table", "json", "html", "svg")


# --- Building the plan -----------------------------------------------------------------------------


def build_plan(objs: Objects, *, policy: memory.Policy = "vllm", decide: bool = True,
               budget: memory.BudgetPolicy = memory.DEFAULT_POLICY,
               kv_grant: memory.KvGrant = memory.DEFAULT_KV_GRANT,
               learned: Sequence[memory.learned.Record] = (),
               tenancy: validate.Policy = validate.DEFAULT_POLICY, hub: bool = False) -> placement.Plan:
    """Nodes and deployments -> a Plan. decide=False (status): only what the statuses say.
    `learned`: the records of --calibration (a configuration that over-ran books what it used);
    `tenancy`: what a podTemplate may reach, as the operator's --pod-security-level etc. set it;
    `hub`: whether a model outside the catalog may be fetched from the Hugging Face Hub (--hub)."""
    errors = list(objs.errors)
    deployments: dict[str, VLLMDeployment] = {}
    places: dict[str, str] = {}  # key -> "VLLMDeployment ns/name (file document N)"
    for where, data in objs.deployments:
        try:  # the one reader and validator: the webhook and the operator refuse with the same line
            dep = read.deployment(data)
            if data.get("status") is not None:
                try:  # a status out of bounds (negative bytes...) is not restored; the spec is decided again
                    dep = read.deployment(data, status=True)
                except read.SpecError as e:
                    errors.append(f"{where}: status not restored ({e}); decided again")
        except read.SpecError as e:
            errors.append(f"{where}: {e}")
            continue
        if dep.key in deployments:
            errors.append(f"{where}: duplicate of an earlier {KIND} {dep.key}; ignored")
            continue
        try:
            read.checked(dep, catalog_model=catalog.knows(dep.spec.model), policy=tenancy,
                         sources=env_sources(objs, dep))
        except read.SpecError as e:
            errors.append(f"{where}: {e}")
            continue
        deployments[dep.key] = dep
        places[dep.key] = where
    pods = {uid: key for key, dep in deployments.items() if dep.status for uid in dep.status.pod_uids}
    nodes: dict[str, placement.NodeInfo] = {}
    for where, data in objs.nodes:
        got = placement.read_node(data, catalog.gpu_for_label, pods, policy=budget)
        if got.problem:
            errors.append(f"{where}: {got.problem}" + ("; using its GFD labels" if got.info else ""))
        if got.info is None:
            continue  # a CPU-only node (no GPU labels, no inventory) is no error
        node = got.info
        if node.name in nodes:
            errors.append(f"{where}: duplicate node; ignored")
            continue
        nodes[node.name] = node
    admitted: dict[str, list[placement.Booking]] = {}
    flags: dict[str, memory.Flags] = {}
    requests: list[placement.Request] = []
    shown: dict[str, placement.Decision] = {}
    for position, (key, dep) in enumerate(deployments.items()):  # input order (request_from_object)
        st = dep.status
        if st and st.phase in ("Admitted", "Running") and st.memory:
            admitted[key] = placement.bookings_from_status(key, st)
            if st.flags:
                flags[key] = st.flags  # the one flag type: the status's are the ledger's
        elif not decide:
            phase = st.phase if st else "Pending"
            shown[key] = placement.Decision(
                key,
                cast(placement.DecisionPhase, phase),
                reasons=tuple(st.reasons if st else ()),
                suggestions=tuple(st.suggestions if st else ()),
                warnings=tuple(st.warnings if st else ()),
                message=phase,
            )
        try:
            model = resolve_model(dep, objs.configmaps, hub=hub)
        except resolve.ModelResolutionError as e:
            if key not in admitted:
                errors.append(f"{places[key]}: {hub_words(str(e), 'spec')}")
                shown.pop(key, None)
            continue
        req = placement.request_from_object(dep, model, position)
        requests.append(replace(req, learned=memory.learned.for_model(learned, model.name)) if learned else req)
    notes = _dra_nodes(objs, nodes, admitted)
    if decide:
        plan = placement.plan(
            nodes.values(), requests, admitted=admitted, admitted_flags=flags, policy=policy, kv_grant=kv_grant
        )
    else:
        plan = placement.plan(nodes.values(), [], admitted=admitted, admitted_flags=flags, policy=policy)
        plan.requests.update({r.key: r for r in requests})
        plan.decisions.update(shown)
    _show_grants(plan, deployments)
    _larger_nodes(plan, budget)
    plan.errors = sorted(plan.errors + errors)
    plan.warnings = sorted(set(plan.warnings) | set(notes) | set(objs.ignored))
    return plan


def resolve_model(dep: VLLMDeployment, configmaps: Mapping[tuple[str, str], Mapping[str, Any]], *,
                  hub: bool = False) -> ModelArch:
    """The one resolver (vllmfit.sources.resolve), with a modelConfigRef ConfigMap found among the
    input's ConfigMaps (as the operator reads it from the API). Raises ModelResolutionError."""
    ref = resolve.config_map_wanted(dep.spec)
    cm = configmaps.get((dep.metadata.namespace, ref.name)) if ref is not None else None
    data = cm.get("data") if isinstance(cm, Mapping) else None
    return resolve.resolve(dep.spec, dep.metadata.namespace,
                           None if cm is None else data if isinstance(data, Mapping) else {}, hub=hub)


def env_sources(objs: Objects, dep: VLLMDeployment) -> validate.Sources:
    """The keys of the input's ConfigMaps that the vllm container's envFrom names; a Secret, or a
    ConfigMap not in the input, is unread (refused), as it is in the operator."""
    out: dict[tuple[str, str], dict[str, str] | None] = {}
    for kind, name in validate.sources_needed(dep.spec):
        cm = objs.configmaps.get((dep.metadata.namespace, name)) if kind == "ConfigMap" else None
        data = (cm.get("data") or {}) if isinstance(cm, Mapping) else None
        out[(kind, name)] = {str(k): str(v) for k, v in data.items()} if isinstance(data, Mapping) else None
    return out


def _show_grants(plan: placement.Plan, deployments: Mapping[str, VLLMDeployment]) -> None:
    """A deployment kept from its status shows the KV grant the status names (status.kvCache)."""
    for key, d in plan.decisions.items():
        st = deployments[key].status if key in deployments else None
        kv = st.kv_cache if st else None
        if d.restored and d.replicas and kv is not None and kv.granted_by:
            z = replace(d.replicas[0].sizing, granted_tokens=kv.tokens, grant=kv.granted_by,
                        request_tokens=kv.request_tokens or 0, limit_tokens=kv.limit_tokens or 0)
            plan.decisions[key] = replace(d, replicas=(replace(d.replicas[0], sizing=z), *d.replicas[1:]))


def _larger_nodes(plan: placement.Plan, budget: memory.BudgetPolicy) -> None:
    """A deployment that needs more GPUs than any node has also gets the fix `estimate` offers from
    the catalog: a larger GPU type (a node of that many larger GPUs), with fewer pipeline stages,
    checked by sizing (the cluster has no such node to check it on)."""
    most = plan.ledger.most_of_one_type()
    gpus = plan.ledger.gpu_types()
    for key, d in plan.decisions.items():
        req = plan.requests.get(key)
        if d.admitted or req is None or not gpus:
            continue
        s = placement.settings_from_spec(req.spec)
        if not 0 < most < s.gpus:
            continue
        largest = max(gpus, key=lambda g: (g.cuda_total_bytes, g.product))
        found = [f for f in memory.one_node_fixes(req.model, s, largest, most, tuple(catalog.gpus().values()), budget)
                 if f.startswith("a larger GPU") and f not in d.suggestions]
        plan.decisions[key] = replace(d, suggestions=(*d.suggestions, *found))


def _dra_nodes(objs: Objects, nodes: dict[str, placement.NodeInfo],
               admitted: Mapping[str, list[placement.Booking]]) -> list[str]:
    """Nodes whose GPUs ResourceSlices publish with shareable memory: their GPUs (and UUIDs) from
    the slices, and the memory every allocated ResourceClaim vllmfit did not make consumes there
    as foreign use (vllmfit.backends.dra). Returns one line per such claim."""
    if not objs.slices:
        return []
    from vllmfit.backends import dra

    drivers = sorted({str((s.get("spec") or {}).get("driver")) for s in objs.slices})
    devices = dra.devices_from_slices(objs.slices, drivers)
    uses = dra.consumption(objs.claims, {d.key: d for devs in devices.values() for d in devs})
    booked: dict[tuple[str, int], int] = {}
    for bookings in admitted.values():
        for b in bookings:
            booked[(b.node, b.index)] = booked.get((b.node, b.index), 0) + b.footprint.total
    notes = []
    for name, devs in sorted(devices.items()):
        if dra.backend_for("auto", devs) != "dra":
            continue
        known = nodes.get(name)
        agent = known if known and any(s.uuid for s in known.gpus) else None
        mine = [u for u in uses if u.device[:2] in {d.key[:2] for d in devs}]
        nodes[name] = dra.node_from_dra(name, known.labels if known else {}, devs, mine, catalog.gpu_for_label,
                                        booked=booked, agent=agent)
        notes += [f"{name} GPU {i}: {memory.fmt_gib(n)} claimed by ResourceClaim {claim} (foreign use)"
                  for i, claim, n in dra.foreign_claims(name, devs, mine, agent)]
    return notes


def exit_code(plan: placement.Plan) -> int:
    """2 when any input is in error (a bad document, field, model, kind), else 1 when anything does
    not fit (a deployment refused, or a replica left unplaced), else 0."""
    if plan.errors:
        return 2
    return 0 if all(d.admitted for d in plan.decisions.values()) else 1


def emit(plan: placement.Plan, output: str, out_file: str | None, title: str) -> None:
    """Write the plan as a table (rich), JSON, HTML or SVG to stdout or a file."""
    if output == "table":
        if out_file:
            try:
                with open(out_file, "w", encoding="utf-8") as f:
                    render.print_plan(console(f), plan)
            except OSError as e:
                raise UserError(f"cannot write {out_file}: {e.strerror or e}") from None
        else:
            render.print_plan(console(), plan)
        return
    text = {
        "json": lambda: placement.to_json(plan) + "\n",
        "html": lambda: render.plan_html(plan, title),
        "svg": lambda: render.plan_svg(plan, title),
    }[output]()
    if out_file:
        try:
            Path(out_file).write_text(text, encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot write {out_file}: {e.strerror or e}") from None
    else:
        sys.stdout.write(text)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while `vllmfit plan` reads its files, decides and
    writes, then restored as it was. A plan allocates millions of objects that hold no reference
    cycles (nodes, bookings, decisions, footprints: freed by reference counting alone); each full
    collection walks all of them, about 17 % of a 40,000-deployment plan's CPU at 80,000 GPUs, and
    finds nothing to free. Before the collector is enabled again, the objects made meanwhile move
    to its oldest generation at once (gc.freeze, then gc.unfreeze): left in the youngest, the first
    collection would walk them all (about 0.4 s at that size). A process-wide switch: the one-shot
    CLI turns it, never the core."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


def run_plan(args: argparse.Namespace) -> int:
    with collector_paused():
        return _run_plan(args)


def _run_plan(args: argparse.Namespace) -> int:
    objs = read_objects(read_files(args.filename))
    from vllmfit.cli import calibration
    from vllmfit.cli.policy import budget_from_args

    learned = calibration.read(args.calibration) if args.calibration else []
    plan = build_plan(objs, policy=args.policy, budget=budget_from_args(args), kv_grant=choices.kv_grant_from_args(args),
                      tenancy=choices.tenancy_from_args(args), learned=learned, hub=args.hub)
    if not plan.ledger.nodes and not plan.decisions:
        detail = f": {plan.errors[0]}" if plan.errors else ""
        raise UserError(f"nothing to plan: no usable Node or {KIND} in the input{detail}")
    if not plan.ledger.nodes:
        detail = f" ({plan.errors[0]})" if plan.errors else ""
        raise UserError(f"no GPU node in the input to place {len(plan.decisions)} {KIND}(s) on{detail}; add the "
                        "cluster's nodes: -f nodes.yaml (kubectl get nodes -o yaml), e.g. -f examples/cluster.yaml")
    title = "vllmfit plan: " + ", ".join(args.filename)
    verdict = write_then(exit_code(plan), lambda: emit(plan, args.output, args.out_file, title))
    output.errors(plan.errors, "vllmfit plan")
    if args.out_file:
        output.wrote(args.out_file, verdict)
    return verdict


# --- argparse ------------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan deployments onto the GPUs of a cluster file",
        description="Place every VLLMDeployment of the input onto the GPUs of its nodes and show, per GPU, "
        "what each deployment takes, which fit where with which flags, and why the others do not.",
        epilog="Exit code: 0 every deployment fits; 1 any does not fit; 2 any input error (a bad document, "
        "field, model or kind: each listed on stderr, one line, the rest still planned and shown). A reader "
        "that leaves early (plan | head) is a normal end: the exit code stays the verdict. Output to a pipe "
        "or file is never wrapped (laid out for COLUMNS when set). Nothing is read from the network without --hub.",
    )
    p.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE",
        help="YAML with Nodes and VLLMDeployments (kubectl get nodes,vllmdeployments -A -o yaml), and "
        "on DRA clusters ResourceSlices and ResourceClaims (kubectl get resourceslices,resourceclaims -A -o yaml); "
        "repeatable; - reads stdin",
    )
    output_args(p)
    p.add_argument(
        "--policy",
        choices=("vllm", "adr"),
        default="vllm",
        help="memory model: vllm (what vLLM does, default) or adr (ADR-0002 formulas)",
    )
    from vllmfit.cli import calibration
    from vllmfit.cli.policy import add_budget_args

    add_budget_args(p)  # the cluster-wide budget policy; node labels still override it per node pool
    choices.add_kv_grant_arguments(p)  # the cluster's default KV grant (the operator's --default-kv-grant)
    choices.add_tenancy_arguments(p)  # what a podTemplate may reach (the operator's --pod-security-level, ...)
    calibration.add_argument(p)
    inputs.hub_argument(p)
    p.set_defaults(func=run_plan)


def output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--output",
        choices=OUTPUTS,
        default="table",
        help="output format, as in kubectl: table (terminal), json (the plan as data), html (self-contained "
        "report), svg (bars)",
    )
    p.add_argument("--out-file", metavar="FILE", help="write to FILE instead of stdout")
