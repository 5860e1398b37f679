"""Kubernetes resource quantities ("20Gi", "1.5G", "512Mi", "2e9") as integer bytes.

The grammar is apimachinery's `resource.Quantity` (k8s.io/apimachinery/pkg/api/resource/quantity.go):

    <quantity>        ::= <signedNumber><suffix>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>

As `Quantity.Value()` does, a fractional number of bytes is rounded up. Pure: no Kubernetes import
(the core may not import one); tests compare it with `kubernetes.utils.parse_quantity`.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
            "P": Decimal(10**15), "E": Decimal(10**18)}
QUANTITY_PATTERN = r"^[+]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+|[numkMGTPE])?$"
"""A non-negative quantity, for the CRD schema (the API server checks it before vllmfit sees it)."""
_QUANTITY = re.compile(
    r"^(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|[eE](?P<exp>[+-]?\d+)|(?P<dec>[numkMGTPE]?))$"
)


def parse_bytes(value: object, what: str = "quantity") -> int:
    """A Kubernetes quantity (or a plain number) as an integer number of bytes, rounded up.
    Raises ValueError with one line naming `what` and the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is not a quantity (use e.g. 20Gi, 512Mi or 21474836480)")  # noqa: TRY004 - pydantic turns ValueError into a validation error
    if isinstance(value, int):
        n: Decimal = Decimal(value)
    else:
        text = str(value).strip()
        m = _QUANTITY.match(text)
        if not m:
            raise ValueError(f"{what} {value!r} is not a Kubernetes quantity (use e.g. 20Gi, 512Mi or 21474836480)")
        n = Decimal(m["num"])
        if m["bin"]:
            n *= _BINARY[m["bin"]]
        elif m["exp"] is not None:
            if abs(int(m["exp"])) > 30:
                raise ValueError(f"{what} {value!r} is out of range")
            n = n.scaleb(int(m["exp"]))
        else:
            n *= _DECIMAL[m["dec"] or ""]
    if n < 0:
        raise ValueError(f"{what} {value!r} must not be negative")
    return math.ceil(n)


def format_bytes(n: int) -> str:
    """The shortest exact binary quantity for n bytes: 21474836480 -> '20Gi', 1000 -> '1000'."""
    for suffix, mult in reversed(_BINARY.items()):
        if n and n % mult == 0:
            return f"{n // mult}{suffix}"
    return str(n)
