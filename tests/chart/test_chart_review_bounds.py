"""The webhook's timeout and the review's bounds are named together (issue 29): the chart's
webhook.timeoutSeconds is core.defaults.WEBHOOK_TIMEOUT_S, the operator is told it, and one review
(model resolution, waiting for a worker, deciding) gets less than it; fail-open is off unless the
chart asks for it."""

from __future__ import annotations

import yaml

from vllmfit import main as cli
from vllmfit.core import defaults
from vllmfit.operator.admission import webhook

from .conftest import CHART, one


def _operator_args(docs) -> list[str]:
    (c,) = [c for c in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
            if c["name"] == "operator"]
    return c["args"]


def test_the_charts_timeout_is_the_one_the_review_budget_is_cut_from(render):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["webhook"]["timeoutSeconds"] == defaults.WEBHOOK_TIMEOUT_S
    assert values["webhook"]["failOpen"] is False
    docs = render()
    hook = one(docs, "ValidatingWebhookConfiguration")["webhooks"][0]
    args = _operator_args(docs)
    assert f"--webhook-timeout-seconds={hook['timeoutSeconds']}" in args and "--webhook-fail-open" not in args
    adm = webhook.admission_of(cli.build_parser().parse_args(["operator", *(a for a in args if "$(" not in a)]))
    assert adm.budget_s == defaults.REVIEW_BUDGET_S < hook["timeoutSeconds"] and not adm.fail_open
    assert defaults.REVIEW_DECIDE_TIMEOUT_S <= defaults.REVIEW_BUDGET_S


def test_a_longer_timeout_and_fail_open_reach_the_operator(render):
    docs = render("default", "--set", "webhook.timeoutSeconds=10", "--set", "webhook.failOpen=true")
    args = _operator_args(docs)
    assert "--webhook-timeout-seconds=10" in args and "--webhook-fail-open" in args
    adm = webhook.admission_of(cli.build_parser().parse_args(["operator", *(a for a in args if "$(" not in a)]))
    assert adm.budget_s == 6.0 and adm.fail_open
