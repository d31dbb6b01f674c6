"""Grafana dashboards for hybridmon, built in Python (grafana-foundation-sdk) by
`python -m hybridmon.dashboards.generate` into dashboards/json/.

This module reads the committed JSON only, so tools that run the panels' queries (the end-to-end
test against a live Prometheus) need neither the SDK nor Grafana:

    for q in all_panel_queries({"datasource": "prom", "instance": "127.0.0.1:9400", "gpu": "0", "endpoint": ".*",
                                "__rate_interval": "1m", "__interval": "15s", "__range": "1h"}):
        ...  # q.dashboard_uid, q.panel_title, q.ref_id, q.instant, q.expr (PromQL, variables substituted)
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

JSON_DIR = Path(__file__).resolve().parent / "json"
# $name and ${name}: Grafana's forms in these dashboards; $1 (a label_replace group) is not a variable.
VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)")


@dataclass(frozen=True)
class PanelQuery:
    dashboard_uid: str
    panel_title: str
    ref_id: str
    instant: bool
    expr: str


def load_dashboards(directory: Path = JSON_DIR) -> list[dict]:
    paths = sorted(directory.glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no dashboards in {directory}: run python -m hybridmon.dashboards.generate")
    return [json.loads(path.read_text()) for path in paths]


def panels(dashboard: Mapping) -> Iterator[dict]:
    """Every panel but the rows themselves, including those inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def substitute(expr: str, variables: Mapping[str, str], where: str) -> str:
    missing = sorted({a or b for a, b in VARIABLE.findall(expr)} - set(variables))
    if missing:
        raise ValueError(f"{where}: no value given for template variable(s) {', '.join(missing)}")
    return VARIABLE.sub(lambda m: str(variables[m.group(1) or m.group(2)]), expr)


def all_panel_queries(variables: Mapping[str, str], directory: Path = JSON_DIR) -> list[PanelQuery]:
    """Every panel query of every dashboard, with the template variables ($instance, $gpu,
    $endpoint, $datasource, $__rate_interval, $__interval, $__range...) replaced by `variables[name]`.
    Raises ValueError naming the panel when an expression uses a variable not given."""
    found = []
    for dashboard in load_dashboards(directory):
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                where = f"{dashboard['uid']} / {panel['title']} / {target.get('refId')}"
                found.append(PanelQuery(dashboard["uid"], panel["title"], target.get("refId", ""),
                                        bool(target.get("instant")), substitute(target["expr"], variables, where)))
    return found
