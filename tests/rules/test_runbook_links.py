"""Runbook links (rules/runbook_links.py): a base URL gives every alert BASE/<AlertName> through
both doors (the Prometheus rules, the agent's own findings), a bad base is refused, and the
default never renders `http:///` nor points HybridmonAgentDown at the agent that is down. What
Prometheus's template language makes of the default is checked by promtool over
rules/tests/generated_runbook_links.yml and generated_agent_down.yml (tests/rules/test_rules.py)."""
from __future__ import annotations

import copy
import io
import shutil
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

from hybridmon.agent.alerts import catalogue
from hybridmon.agent.alerts.agent_down import ALERTNAME as AGENT_DOWN
from hybridmon.agent.alerts.catalogue import load_thresholds
from hybridmon.agent.cli import EXIT_OK, EXIT_USAGE, main as hybridmon
from hybridmon.agent.config import DEFAULT_LISTEN, ConfigError, load_config
from hybridmon.agent.publish import findings
from hybridmon.rules import generate
from hybridmon.rules.runbook_links import LOCAL_AGENT_RUNBOOKS, runbook_base_url, with_runbook_base
from hybridmon.rules.templates import expected_text, go_template
from deploy.kubernetes import generate_prometheusrule

REPO = Path(__file__).resolve().parents[2]
BASE = "https://runbooks.example.org/hybridmon"


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = hybridmon(list(argv))
    return code, out.getvalue(), err.getvalue()


def alert_rules(document: dict) -> list[dict]:
    return [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]


def without_runbook_urls(document: dict) -> dict:
    stripped = copy.deepcopy(document)
    for rule in alert_rules(stripped):
        del rule["annotations"]["runbook_url"]
    return stripped


@pytest.mark.parametrize("given, base", [
    ("https://runbooks.example.org/hybridmon", BASE),
    ("https://runbooks.example.org/hybridmon/", BASE),
    ("  http://wiki.internal:8080/ops/runbooks//  ", "http://wiki.internal:8080/ops/runbooks"),
    ("http://[fd00::7]:9787/runbooks", "http://[fd00::7]:9787/runbooks"),
    ("https://git.example.org", "https://git.example.org"),
])
def test_a_base_is_an_http_url_with_a_host_without_its_trailing_slash(given, base):
    assert runbook_base_url(given) == base


@pytest.mark.parametrize("given, says", [
    ("", "not an http(s) URL with a host"),
    ("wiki", "not an http(s) URL with a host"),
    ("runbooks.example.org/hybridmon", "not an http(s) URL with a host"),
    ("ftp://runbooks.example.org/hybridmon", "not an http(s) URL with a host"),
    ("http:///runbooks", "not an http(s) URL with a host"),
    ("https://runbooks.example.org:99999/x", "is not a URL"),
    ("https://runbooks.example.org/x?page=", "query or fragment"),
    ("https://runbooks.example.org/x#top", "query or fragment"),
    ("http://{{ $labels.instance }}/runbooks", "holds"),
    ("https://runbooks.example.org/my runbooks", "holds"),
])
def test_a_bad_base_is_refused_saying_what_is_wrong(given, says):
    with pytest.raises(ValueError, match="runbook URL base") as refused:
        runbook_base_url(given)
    assert says in str(refused.value)


def test_hybridmon_rules_gives_the_base_on_every_alert_and_changes_nothing_else(tmp_path):
    code, text, err = run_cli("rules", "--runbook-url-base", BASE)
    assert (code, err) == (EXIT_OK, "")
    document, shipped = yaml.safe_load(text), yaml.safe_load((REPO / "rules/hybridmon.rules.yml").read_text())
    alerts = alert_rules(document)
    assert len(alerts) == len(alert_rules(shipped)) and {r["alert"] for r in alerts} == set(catalogue.all_alertnames())
    assert [rule["annotations"]["runbook_url"] for rule in alerts] == [f"{BASE}/{rule['alert']}" for rule in alerts]
    assert without_runbook_urls(document) == without_runbook_urls(shipped)
    assert "{{ if $labels.instance }}" not in text and "http://" not in text  # no default link is left
    # A trailing slash is the same base; --output writes the same text.
    assert run_cli("rules", "--runbook-url-base", f"{BASE}/")[1] == text
    assert run_cli("rules", "--runbook-url-base", BASE, "--output", str(tmp_path / "r.yml"))[0] == EXIT_OK
    assert (tmp_path / "r.yml").read_text() == text


@pytest.mark.slow
def test_promtool_accepts_the_rules_with_a_base(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: install Debian's `prometheus` package (scripts/test does, as root)"
    path = tmp_path / "hybridmon.rules.yml"
    path.write_text(run_cli("rules", "--runbook-url-base", BASE)[1])
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("bad", ["runbooks.example.org", "http://", "https://x.example/?a=1"])
def test_hybridmon_rules_refuses_a_bad_base_as_a_usage_error_and_writes_nothing(tmp_path, bad):
    output = tmp_path / "rules.yml"
    code, text, err = run_cli("rules", "--runbook-url-base", bad, "--output", str(output))
    assert code == EXIT_USAGE and text == "" and not output.exists()
    assert "--runbook-url-base" in err and "runbook URL base" in err


def test_without_a_base_plain_rules_is_the_shipped_file():
    code, text, _err = run_cli("rules")
    assert code == EXIT_OK and text == (REPO / "rules/hybridmon.rules.yml").read_text()


def test_the_default_never_renders_an_empty_host_nor_the_agent_that_is_down():
    """The default's marker text filled as Prometheus fills the template (promtool shows the same
    in rules/tests/generated_runbook_links.yml): with an instance, that agent; without one, the
    local agent; HybridmonAgentDown always the local agent."""
    rules = [alert for group in catalogue.rule_groups(load_thresholds()) for alert in group.alerts()]
    shipped = {(r["alert"], tuple(sorted(r["labels"].items()))): r["annotations"]["runbook_url"]
               for r in alert_rules(yaml.safe_load((REPO / "rules/hybridmon.rules.yml").read_text()))}
    for rule in rules:
        text = rule.runbook(None)
        assert shipped[(rule.alert, tuple(sorted({"severity": rule.severity, **rule.labels}.items())))] == go_template(text, {})
        without = expected_text(text, {"instance": ""})
        assert without == f"{LOCAL_AGENT_RUNBOOKS}/{rule.alert}" and "///" not in without
        expected = without if rule.alert == AGENT_DOWN else f"http://gpu-host-1:9787/runbooks/{rule.alert}"
        assert expected_text(text, {"instance": "gpu-host-1:9787"}) == expected
    assert LOCAL_AGENT_RUNBOOKS == f"http://{DEFAULT_LISTEN}/runbooks"


def test_both_doors_give_the_same_link_for_the_same_base():
    """The rules generated with a base, the agent's findings with [alerting] runbook_base_url set
    to it (with a trailing slash, as a wiki's address is often copied)."""
    config = load_config(None, overrides={"alerting": {"runbook_base_url": f"{BASE}/"}})
    agent_base = config.alerting.runbook_base_url
    rendered = yaml.safe_load(generate.render(load_thresholds(), runbook_base_url(f"{BASE}/"))[generate.RULES_FILE])
    for rule in alert_rules(rendered):
        assert rule["annotations"]["runbook_url"] == findings.runbook_url(agent_base, rule["alert"]) \
            == f"{BASE}/{rule['alert']}"


def test_a_bad_base_in_the_configuration_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides={"alerting": {"runbook_base_url": "wiki.example/runbooks"}})
    assert "alerting.runbook_base_url" in str(refused.value) and "http(s) URL with a host" in str(refused.value)


def test_the_generators_take_the_base_and_refuse_a_bad_one(tmp_path, capsys):
    assert generate.main(["--output-dir", str(tmp_path), "--runbook-url-base", f"{BASE}/"]) == 0
    assert all(r["annotations"]["runbook_url"] == f"{BASE}/{r['alert']}"
               for r in alert_rules(yaml.safe_load((tmp_path / generate.RULES_FILE).read_text())))
    with pytest.raises(SystemExit) as refused:
        generate.main(["--output-dir", str(tmp_path), "--runbook-url-base", "http:///runbooks"])
    assert refused.value.code == 2 and "not an http(s) URL with a host" in capsys.readouterr().err


def test_the_prometheusrule_takes_the_base_and_keeps_everything_else(tmp_path):
    assert generate_prometheusrule.main(["--runbook-url-base", BASE, "--output-dir", str(tmp_path)]) == 0
    resource = yaml.safe_load((tmp_path / generate_prometheusrule.OUTPUT_FILE).read_text())
    shipped = yaml.safe_load((REPO / "deploy/kubernetes" / generate_prometheusrule.OUTPUT_FILE).read_text())
    alerts = alert_rules(resource["spec"])
    assert alerts and all(r["annotations"]["runbook_url"] == f"{BASE}/{r['alert']}" for r in alerts)
    assert without_runbook_urls(resource["spec"]) == without_runbook_urls(shipped["spec"])
    assert resource["metadata"] == shipped["metadata"]


def test_rebasing_a_document_that_is_no_rule_file_is_refused():
    with pytest.raises(ValueError, match="no list of rule groups"):
        with_runbook_base({"rules": []}, BASE)
