"""Runbooks: one per alert, complete, no placeholders, every link resolving."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from hybridmon.agent.alerts.catalogue import FAMILIES, Thresholds

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "runbooks"
DAEMONSET = REPO / "deploy" / "kubernetes" / "daemonset.yaml"
RULES_FILE = REPO / "rules" / "hybridmon.rules.yml"
SECTIONS = ("Meaning", "Impact", "Diagnosis", "Mitigation")
# The thresholds section each alert reads, from the catalogue.
THRESHOLD_SECTION = {name: family.section for family in FAMILIES for name in family.alertnames}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def alert_severities() -> dict[str, set[str]]:
    severities: dict[str, set[str]] = {}
    for group in yaml.safe_load(RULES_FILE.read_text())["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                severities.setdefault(rule["alert"], set()).add(rule["labels"]["severity"])
    return severities


def runbooks() -> dict[str, Path]:
    return {path.stem: path for path in sorted(RUNBOOKS.glob("*.md")) if path.name != "README.md"}


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {title.strip(): body.strip() for title, body in zip(parts[1::2], parts[2::2])}


def test_alerts_and_runbooks_are_one_to_one():
    assert set(runbooks()) == set(alert_severities())
    assert set(runbooks()) == set(THRESHOLD_SECTION)


def test_the_index_lists_every_runbook_once():
    index = (RUNBOOKS / "README.md").read_text()
    linked = [target for target in LINK.findall(index) if target.endswith(".md")]
    assert sorted(linked) == sorted(f"{name}.md" for name in runbooks())


@pytest.mark.parametrize("name", sorted(THRESHOLD_SECTION))
def test_runbook_has_title_severity_thresholds_and_the_four_sections(name):
    text = (RUNBOOKS / f"{name}.md").read_text()
    assert text.startswith(f"# {name}\n")
    header = text.split("\n## ", 1)[0]
    severity_line = re.search(r"\*\*Severity:\*\*([^*]*)", header)
    assert severity_line, f"{name}: no **Severity:** line"
    for severity in alert_severities()[name]:
        assert severity in severity_line.group(1), f"{name}: severity {severity} not named"
    section = THRESHOLD_SECTION[name]
    assert f"`[{section}]`" in header and "agent/alerts/thresholds.toml" in header
    keys = [key for key in Thresholds.model_fields[section].annotation.model_fields if f"`{key}`" in header]
    assert keys or section == "host_config", f"{name}: names no key of [{section}]"
    found = sections(text)
    assert [title for title in found if title in SECTIONS] == list(SECTIONS)
    for title in SECTIONS:
        assert len(found[title]) > 80, f"{name}: section {title} is nearly empty"


def test_runbooks_name_the_keys_they_depend_on():
    """Each key of a detector's section appears in at least one runbook reading that section."""
    text_by_section: dict[str, str] = {}
    for name, section in THRESHOLD_SECTION.items():
        text_by_section[section] = text_by_section.get(section, "") + (RUNBOOKS / f"{name}.md").read_text()
    for section, text in text_by_section.items():
        for key in Thresholds.model_fields[section].annotation.model_fields:
            assert f"`{key}`" in text, f"[{section}] {key} is in no runbook"


def test_no_placeholders():
    for path in RUNBOOKS.glob("*.md"):
        text = path.read_text()
        for word in ("TODO", "TBD", "FIXME", "XXX"):
            assert word not in text, f"{path.name} contains {word}"


def test_every_relative_link_resolves():
    for path in RUNBOOKS.glob("*.md"):
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            assert (path.parent / target.split("#")[0]).resolve().exists(), f"{path.name}: {target}"


def test_memory_growth_runbook_says_what_it_cannot_prove():
    text = (RUNBOOKS / "InferenceProcessMemoryGrowth.md").read_text()
    assert "## What this can and cannot prove" in text
    assert "cannot see pointers" in text and "cannot prove stale references" in text


def test_runbooks_carry_the_case_studies_caveats():
    text = " ".join(path.read_text() for path in RUNBOOKS.glob("*.md"))
    for fact in ("0.8 %", "4-7x", "8 s", "128 tokens", "512", "vm.swappiness=10", "vm.dirty_ratio=15",
                 "LimitMEMLOCK=infinity", "numactl --cpunodebind", "--membind"):
        assert fact in text, fact


def test_runbooks_state_their_facts_instead_of_citing_case_studies():
    """"The third case study" points at a document the reader does not have (the project's seed
    notes): a runbook says what happened, in its own words, where it uses the fact."""
    for path in sorted(RUNBOOKS.glob("*.md")):
        text = path.read_text()
        found = re.search(r"case[\s-]+stud", text, flags=re.I)  # also across a line break
        assert found is None, f"{path.name}:{text.count(chr(10), 0, found.start()) + 1}: {found.group(0)!r}"


# --- commands against the agent, and the same in Kubernetes ----------------------------------------

FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)
AGENT_COMMAND = re.compile(r"^(?:sudo )?(hybridmon [a-z]+(?: [^#]*?)?)\s*(?:#.*)?$", re.M)


def daemonset_access() -> tuple[str, dict[str, str], int]:
    """The namespace, pod labels and port of the shipped DaemonSet, which the runbooks must name."""
    daemonset = yaml.safe_load(DAEMONSET.read_text())
    [container] = daemonset["spec"]["template"]["spec"]["containers"]
    [port] = [p["containerPort"] for p in container["ports"]]
    return daemonset["metadata"]["namespace"], daemonset["spec"]["selector"]["matchLabels"], port


def test_every_command_against_the_agent_also_shows_the_kubernetes_way():
    """A curl against 127.0.0.1:<port> runs on the alert's host; in Kubernetes the agent is a pod:
    the first such block of a page (or one before it) forwards the pod's port, and every
    `hybridmon ...` command has its `kubectl exec` twin in the same block."""
    namespace, _labels, port = daemonset_access()
    forward = f"# Kubernetes: kubectl -n {namespace} port-forward pod/<agent-pod> {port} & first (README.md: Reaching the agent)"
    pages = {**runbooks(), "README": RUNBOOKS / "README.md"}
    shown = 0
    for name, path in pages.items():
        forwarded = False
        for block in FENCE.findall(path.read_text()):
            for line in block.splitlines():
                forwarded = forwarded or line.strip() == forward
                if f"127.0.0.1:{port}" in line and not line.lstrip().startswith("#"):
                    assert forwarded, f"{name}: {line.strip()!r} comes before {forward!r}"
                    shown += 1
            for command in AGENT_COMMAND.findall(block):
                twin = f"# Kubernetes: kubectl -n {namespace} exec pod/<agent-pod> -- {command.strip()}"
                assert twin in block.splitlines(), f"{name}: {command!r} without {twin!r} in its block"
                shown += 1
    assert shown >= 30  # the check found the commands it is about


def test_reaching_the_agent_names_the_daemonsets_namespace_labels_and_port():
    namespace, labels, port = daemonset_access()
    text = sections((RUNBOOKS / "README.md").read_text())["Reaching the agent"]
    selector = ",".join(f"{key}={value}" for key, value in labels.items())
    for needed in (f"kubectl -n {namespace} get pods -l {selector}", "--field-selector spec.nodeName=<node>",
                   f'kubectl -n {namespace} port-forward "$POD" {port}', f'kubectl -n {namespace} exec "$POD" -- hybridmon',
                   f"namespace `{namespace}`", f"`{selector}`", "--runbook-url-base"):
        assert needed in text, needed


def test_the_served_pages_show_the_kubernetes_way_in_their_commands():
    """What a runbook_url opens: the agent's HTML of each page (agent/api/runbooks.py), the
    placeholders escaped inside the command block, not swallowed as HTML tags."""
    from hybridmon.agent.api.runbooks import RunbookLibrary

    namespace, _labels, port = daemonset_access()
    library = RunbookLibrary(RUNBOOKS)
    forwarding = [name for name, path in runbooks().items()
                  if any(f"127.0.0.1:{port}" in block for block in FENCE.findall(path.read_text()))]
    assert forwarding
    for name in forwarding:
        page = library.page_html(name)
        assert f"kubectl -n {namespace} port-forward pod/&lt;agent-pod&gt; {port} &amp; first" in page, name
        assert "<code" in page.split("port-forward", 1)[0].rsplit("<pre>", 1)[-1], name
