"""Where an alert's runbook_url points, for both doors: the Prometheus rules and the agent's own findings.

With a base URL (`hybridmon rules --runbook-url-base`, the generators' `--runbook-url-base`,
`[alerting] runbook_base_url`) every alert links to BASE/<AlertName>, whichever door it comes
out of. The base is checked once, here, so a typo is a clear error and not a dead link in a page.

Without one, the rules fall back to a default that needs no configuration and is never `http:///`:

- an alert about a host links to the agent that raised it, `http://<instance>/runbooks/<Alert>`:
  every agent serves every runbook (agent/api/runbooks.py), matching its own version, on
  air-gapped hosts too, and that is the address Prometheus already reaches;
- where the alert has no `instance` (an `absent()` rule, a relabelling that dropped it), and for
  HybridmonAgentDown, whose instance is the agent that cannot answer, the link is
  `http://127.0.0.1:9787/runbooks/<Alert>`: the agent's default listen address, which any running
  agent answers on its own host, and a laptop reaches with
  `kubectl -n monitoring port-forward pod/<agent-pod> 9787` (runbooks/README.md). A fixed, working
  address beats a guess: Prometheus knows no other agent's address to offer in a template.

Alertmanager's receivers in a cluster cannot reach pod IPs, so a Kubernetes install should set a
base it serves the runbooks at (deploy/README.md); the default is what works before anyone has.
"""
from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

# The agent's default listen address (agent/config.py DEFAULT_LISTEN; tests/rules/test_runbook_links.py
# holds them equal): rules/ does not import the agent.
LOCAL_AGENT_RUNBOOKS = "http://127.0.0.1:9787/runbooks"
# rules.templates markers: the alert's own agent where Prometheus names one, the local agent otherwise.
FROM_THE_ALERTING_AGENT = f"<if instance>http://<instance>/runbooks<else>{LOCAL_AGENT_RUNBOOKS}<end>"
# Characters that would make BASE/<Alert> something else than a link: template code that only one
# door could render, and what ends a URL in Markdown, HTML or a chat message.
_NOT_IN_A_BASE = set("<>{}\"'` \t\r\n\\|^")


def runbook_base_url(text: str) -> str:
    """`text` as a runbook base URL without its trailing slash; ValueError saying what is wrong."""
    base = text.strip()
    odd = sorted(_NOT_IN_A_BASE & set(base))
    if odd:
        raise ValueError(f"runbook URL base {text!r} holds {''.join(odd)!r}: give a plain "
                         "http(s) URL, e.g. https://runbooks.example.org/hybridmon")
    try:
        parts = urlsplit(base)
        _ = parts.port  # raises ValueError for a port that is not a number from 0 to 65535
    except ValueError as error:
        raise ValueError(f"runbook URL base {text!r} is not a URL: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"runbook URL base {text!r} is not an http(s) URL with a host, "
                         "e.g. https://runbooks.example.org/hybridmon")
    if parts.query or parts.fragment or base.endswith(("?", "#")):
        raise ValueError(f"runbook URL base {text!r} has a query or fragment: "
                         "the alert's name is appended as a path (BASE/<AlertName>)")
    return base.rstrip("/")


def runbook_base_url_argument(text: str) -> str:
    """runbook_base_url as an argparse type: a bad base is a usage error saying what is wrong."""
    try:
        return runbook_base_url(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def runbook_url(base_url: str, alertname: str) -> str:
    """BASE/<AlertName>: what both doors give for the same base, with or without its trailing slash."""
    return f"{base_url.rstrip('/')}/{alertname}"


def runbook_text(alertname: str, base_url: str | None, about_the_alerting_agent: bool = True) -> str:
    """The runbook_url annotation as rules.templates marker text: BASE/<AlertName> for a base,
    otherwise the default above. `about_the_alerting_agent` is False where the alert's instance
    is an agent that cannot answer (HybridmonAgentDown)."""
    if base_url is not None:
        return runbook_url(base_url, alertname)
    if about_the_alerting_agent:
        return f"{FROM_THE_ALERTING_AGENT}/{alertname}"
    return runbook_url(LOCAL_AGENT_RUNBOOKS, alertname)


def with_runbook_base(document: dict[str, Any], base_url: str) -> dict[str, Any]:
    """A rule file's document ({"groups": [...]}, as in rules/hybridmon.rules.yml) whose every
    alerting rule links to BASE/<AlertName>; recording rules and every other key are kept."""
    groups = document.get("groups") if isinstance(document, dict) else None
    if not isinstance(groups, list):
        raise ValueError("not a Prometheus rule file: no list of rule groups")
    rewritten = []
    for group in groups:
        rules = []
        for rule in group.get("rules", []):
            if "alert" in rule:
                annotations = {**rule.get("annotations", {}), "runbook_url": runbook_url(base_url, rule["alert"])}
                rule = {**rule, "annotations": annotations}
            rules.append(rule)
        rewritten.append({**group, "rules": rules})
    return {**document, "groups": rewritten}
