"""`--calibration FILE` of `vllmfit estimate` and `vllmfit plan`: the learned records the operator
keeps in its `vllmfit-calibration` ConfigMap (vllmfit.core.memory.learned), read offline
(`vllmfit calibration --from-log LOG` writes one: `fromlog`)."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from vllmfit.cli import documents
from vllmfit.cli.inputs import read_input
from vllmfit.core import defaults, limits, memory
from vllmfit.core.errors import UserError


def add_argument(p: argparse.ArgumentParser) -> None:
    """--calibration FILE (estimate and plan): the operator's learned records."""
    p.add_argument("--calibration", metavar="FILE",
                   help="learned records: the operator's vllmfit-calibration ConfigMap (kubectl get -o yaml), "
                        "its records.json, a YAML list of records, or what `vllmfit calibration --from-log` "
                        "wrote; a configuration that used more than "
                        "predicted at its first start is booked with what it used")


def read(path: str) -> list[memory.learned.Record]:
    """The records of a --calibration FILE (one line and exit 2 on anything unusable)."""
    def parse(text: str, where: str) -> Any:
        if documents.nesting(text) > limits.MAX_NESTING:
            raise UserError(f"{where}: nested deeper than {limits.MAX_NESTING} levels")
        try:
            return documents.load_yaml(text)
        except yaml.YAMLError as e:
            raise UserError(f"{where}: not YAML: {str(e).splitlines()[0]}") from None

    data = parse(read_input(path), f"--calibration {path}")
    if isinstance(data, dict) and data.get("kind") == "ConfigMap":
        text = (data.get("data") or {}).get(defaults.CALIBRATION_KEY)
        if not isinstance(text, str):
            raise UserError(f"--calibration {path}: the ConfigMap has no data key {defaults.CALIBRATION_KEY}")
        data = parse(text, f"--calibration {path}: data {defaults.CALIBRATION_KEY}")
    return memory.learned.records_from_data(data)

