"""The promtool cases of the default runbook_url (rules/runbook_links.py): Prometheus's template
language decides between the alerting agent and the local one, so promtool, not Python, must show
which link each alert gets. The same alert fires for a host scraped as usual (it has `instance`)
and for one whose series reach Prometheus without `instance` (a federation or remote-write
relabelling that dropped it), which before this default linked to `http:///runbooks/...`."""
from __future__ import annotations

from hybridmon.exporters.host_memory import SYSCTL_VALUE
from tests.support.promtool_cases import HOST, Test, firing, not_yet

ALERTNAME = "HostDirtyRatioHigh"  # any host alert: the simplest rule (a sysctl past a bound, no `for`)


def promtool_cases(thresholds, catalog) -> list[Test]:
    """gpu-host-1 and a host without `instance` both set vm.dirty_ratio past the bound at the onset."""
    bound = thresholds.host_config.max_dirty_ratio
    rule = catalog.find(ALERTNAME)
    test = Test("runbook links: an alert with an instance links to that agent, one without to the "
                "local agent, never to http:///", firing(0) + 60, catalog)
    for instance in (HOST, ""):
        test.gauge(SYSCTL_VALUE.name, bound, bound + 5, instance, sysctl="vm.dirty_ratio")
    test.expect(not_yet(0), ALERTNAME)
    test.expect(firing(0), ALERTNAME, *(test.alert(rule, {}, instance, value=bound + 5) for instance in (HOST, "")))
    return [test]
