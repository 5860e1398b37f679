"""The operator tests' KMock emulator and real operator (tests/operator/conftest.py) and the
webhook tests' HTTPS harness (tests/webhook/webhook_harness.py), for the tenant-attack suite."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_OPERATOR_TESTS = Path(__file__).resolve().parents[1] / "operator"
for _d in (_OPERATOR_TESTS, _OPERATOR_TESTS.parent / "webhook"):  # opkit; webhook_harness (the HTTPS webhook)
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))
_spec = importlib.util.spec_from_file_location("_operator_conftest", _OPERATOR_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
km, cluster, operator = _mod.km, _mod.cluster, _mod.operator
