"""The required node affinity of a spec's podTemplate, which placement honours like the scheduler.

`podTemplate.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution` is a
v1 NodeSelector: its nodeSelectorTerms are ORed, the requirements inside one term ANDed, and a
term with no requirement matches no node. Operators and their meaning are Kubernetes'
(k8s.io/component-helpers/scheduling/corev1/nodeaffinity): In, NotIn, Exists, DoesNotExist,
Gt, Lt on node labels; matchFields supports only `metadata.name` with In and NotIn.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vllmfit.core.memory import SpecError
from vllmfit.core.spec.api import VLLMDeploymentSpec

Requirement = tuple[str, str, tuple[str, ...]]  # (key, operator, values)
Term = tuple[tuple[Requirement, ...], tuple[Requirement, ...]]  # (matchExpressions, matchFields)

PATH = "podTemplate.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
_OPERATORS = {"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"}


def required_terms(spec: VLLMDeploymentSpec) -> tuple[Term, ...] | None:
    """The spec's required node affinity as hashable terms; None when it sets none.
    Raises SpecError (a ValueError; one line naming the field) when it is malformed."""
    tpl = spec.pod_template
    pod = tpl.spec if tpl is not None else None
    if not pod:
        return None
    node_affinity = _get(pod, "affinity", "nodeAffinity")
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") if node_affinity else None
    if required is None:
        return None
    if not isinstance(required, Mapping) or not isinstance(required.get("nodeSelectorTerms"), list):
        raise SpecError(f"{PATH}.nodeSelectorTerms must be a list")
    terms = []
    for i, term in enumerate(required["nodeSelectorTerms"]):
        where = f"{PATH}.nodeSelectorTerms[{i}]"
        if not isinstance(term, Mapping):
            raise SpecError(f"{where} must be an object")
        exprs = _requirements(term.get("matchExpressions"), f"{where}.matchExpressions")
        fields = _requirements(term.get("matchFields"), f"{where}.matchFields")
        for key, op, _ in fields:
            if key != "metadata.name" or op not in ("In", "NotIn"):
                raise SpecError(f"{where}.matchFields supports only metadata.name with In or NotIn")
        terms.append((exprs, fields))
    if not terms:
        raise SpecError(f"{PATH}.nodeSelectorTerms must not be empty")
    return tuple(terms)


def _get(obj: Mapping[str, Any], *path: str) -> Mapping[str, Any] | None:
    for part in path:
        obj = obj.get(part) if isinstance(obj, Mapping) else None  # type: ignore[assignment]
        if obj is None:
            return None
    if not isinstance(obj, Mapping):
        raise SpecError(f"podTemplate.spec.{'.'.join(path)} must be an object")
    return obj


def _requirements(raw: Any, where: str) -> tuple[Requirement, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError(f"{where} must be a list")
    out = []
    for j, r in enumerate(raw):
        if not isinstance(r, Mapping) or not isinstance(r.get("key"), str) or r.get("operator") not in _OPERATORS:
            raise SpecError(f"{where}[{j}] needs a key and an operator ({', '.join(sorted(_OPERATORS))})")
        values = r.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise SpecError(f"{where}[{j}].values must be a list of strings")
        op = r["operator"]
        if op in ("In", "NotIn") and not values:
            raise SpecError(f"{where}[{j}]: {op} needs values")
        if op in ("Exists", "DoesNotExist") and values:
            raise SpecError(f"{where}[{j}]: {op} takes no values")
        if op in ("Gt", "Lt") and (len(values) != 1 or not _is_int(values[0])):
            raise SpecError(f"{where}[{j}]: {op} needs exactly one integer value")
        out.append((r["key"], op, tuple(values)))
    return tuple(out)


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _requirement_matches(value: str | None, op: str, values: tuple[str, ...]) -> bool:
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if value is None or not _is_int(value):
        return False
    return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])


def selected(name: str, labels: Mapping[str, str], selector: Iterable[tuple[str, str]],
             terms: tuple[Term, ...] | None) -> bool:
    """Whether a node (name, labels) is one a pod's nodeSelector (its items) and required node
    affinity (`terms`) select: the one rule `Ledger.matching`, `census.still_matching` and the
    search use."""
    return all(labels.get(k) == v for k, v in selector) and terms_match(name, labels, terms)


def terms_match(name: str, labels: Mapping[str, str], terms: tuple[Term, ...] | None) -> bool:
    """Whether a node (name, labels) satisfies the terms (None: no affinity, every node does)."""
    if terms is None:
        return True
    for exprs, fields in terms:
        if not exprs and not fields:
            continue  # an empty term matches no node
        if all(_requirement_matches(labels.get(k), op, vs) for k, op, vs in exprs) and all(
            _requirement_matches(name, op, vs) for _, op, vs in fields
        ):
            return True
    return False
