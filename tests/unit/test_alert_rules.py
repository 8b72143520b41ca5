"""deploy/prometheus/llmgw-alerts.yml: Prometheus's own ``promtool`` finds the rules valid and its rule
unit tests (tests/data/llmgw-alerts-test.yml: synthetic series from two control planes, each alert
firing when it should and not before its ``for:``) pass; every metric a rule names is one llmgw
exports (tests/helpers/metricnames.py). ``promtool`` comes with Debian's ``prometheus`` package
(.ci/run installs it); without it this fails in CI and skips elsewhere."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from tests.conftest import skip_or_fail
from tests.helpers.metricnames import NAME, ROOT, exported

RULES = ROOT / "deploy" / "prometheus" / "llmgw-alerts.yml"
UNIT_TESTS = ROOT / "tests" / "data" / "llmgw-alerts-test.yml"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        skip_or_fail("promtool not found: apt-get install prometheus (Debian's package has it)")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)


def test_every_rule_names_an_exported_metric() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len(rules) >= 8
    missing = {n for r in rules for n in NAME.findall(r["expr"])} - exported()
    assert not missing, f"the alert rules ask for metrics nobody exports: {sorted(missing)}"
    assert all(r["labels"]["severity"] in ("warning", "critical") for r in rules)


def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    checked = _promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(yaml.safe_load(RULES.read_text())['groups'][0]['rules'])} rules found" in checked.stdout
    tested = _promtool("test", "rules", str(UNIT_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # every alert has a case in the unit tests
    cases = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    named = {c["alertname"] for t in cases for c in t["alert_rule_test"]}
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert named == alerts, alerts ^ named
