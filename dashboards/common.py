"""What both dashboards share: the template variables, query and panel helpers, thresholds drawn from
the agent's thresholds file and links to the runbooks.

Every panel and every query names its datasource through the `$datasource` variable, so the
dashboards import into any Grafana with a Prometheus that scrapes the agent and loads rules/.
"""
from __future__ import annotations

from collections.abc import Sequence

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cog
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from hybridmon.agent.self_metrics import BUILD_INFO
from hybridmon.exporters.gpu import GPU_INFO
from hybridmon.exporters.inference_names import SCRAPE_SUCCESS

# The rules' own default (rules/generate.py): the agent that raised an alert serves its runbook.
DEFAULT_RUNBOOK_BASE_URL = "http://${instance}/runbooks"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
TAGS = ["hybridmon", "generated"]
TIME_COLUMNS = ("Time", "job", "uuid")  # columns no table needs


def selector(metric: str, *matchers: str, gpu: bool = True) -> str:
    """`metric{instance="$instance", gpu=~"$gpu", ...}`: the series of the chosen host and GPUs."""
    labels = ['instance="$instance"', *(['gpu=~"$gpu"'] if gpu else []), *matchers]
    return f"{metric}{{{', '.join(labels)}}}"


def query(expr: str, legend: str = "", ref_id: str = "A", instant: bool = False) -> prometheus.Dataquery:
    built = prometheus.Dataquery().expr(expr).ref_id(ref_id).datasource(DATASOURCE)
    if instant:
        return built.instant().format(PromQueryFormat.TABLE)
    return built.range().legend_format(legend)


def variables(gpu_multi: bool, inference: bool = False) -> list[cog.Builder[model.VariableModel]]:
    """$datasource, $instance (one agent: these are host dashboards), $gpu and, with `inference`,
    $endpoint: the inference servers the agent scrapes, failing ones included."""
    datasource = grafana.DatasourceVariable("datasource").label("Data source").type("prometheus")
    instance = (grafana.QueryVariable("instance").label("Agent").datasource(DATASOURCE)
                .query(f"label_values({BUILD_INFO.name}, instance)")
                .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(model.VariableSort.ALPHABETICAL_ASC))
    gpu = (grafana.QueryVariable("gpu").label("GPU").datasource(DATASOURCE)
           .query(f'label_values({GPU_INFO.name}{{instance="$instance"}}, gpu)')
           .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(model.VariableSort.NATURAL_ASC)
           .multi(gpu_multi).include_all(gpu_multi))
    if not inference:
        return [datasource, instance, gpu]
    # "All" is sent as .* (every endpoint of the agent) rather than a list Grafana would build.
    endpoint = (grafana.QueryVariable("endpoint").label("Inference endpoint").datasource(DATASOURCE)
                .query(f'label_values({SCRAPE_SUCCESS.name}{{instance="$instance"}}, endpoint)')
                .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(model.VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(".*"))
    return [datasource, instance, gpu, endpoint]


Threshold = float | Sequence[float] | None


def threshold_steps(threshold: Threshold = None) -> grafana.ThresholdsConfig:
    """Steps at the thresholds from thresholds.toml: the highest red, any lower one orange."""
    values = sorted([] if threshold is None else [threshold] if isinstance(threshold, (int, float)) else threshold)
    colours = ["orange"] * (len(values) - 1) + ["red"]
    steps = [model.Threshold(value=None, color="green")]
    steps += [model.Threshold(value=float(v), color=c) for v, c in zip(values, colours)]
    return grafana.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(steps)


def link(title: str, url: str) -> grafana.DashboardLink:
    return grafana.DashboardLink(title).type(model.DashboardLinkType.LINK).url(url).target_blank(True)


def runbook_links(base_url: str, *alertnames: str) -> list[grafana.DashboardLink]:
    return [link(f"Runbook: {name}", f"{base_url}/{name}") for name in alertnames]


def _common(panel, title: str, unit: str, description: str, targets, width: int, height: int,
            threshold: Threshold, links: list[grafana.DashboardLink]):
    panel = (panel.title(title).description(description).unit(unit).datasource(DATASOURCE)
             .span(width).height(height).targets(list(targets)).thresholds(threshold_steps(threshold)))
    return panel.links(links) if links else panel


def graph(title: str, unit: str, description: str, *targets: prometheus.Dataquery,
          threshold: Threshold = None, width: int = 12, height: int = 8,
          links: list[grafana.DashboardLink] = (), min_value: float | None = 0) -> timeseries.Panel:
    """A time series panel; a threshold from the config is drawn as a dashed line across it. The
    tooltip lists every series, so traffic reads against its capacity at one glance."""
    panel = _common(timeseries.Panel(), title, unit, description, targets, width, height, threshold, links)
    panel = (panel.legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                          .placement(common.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING)))
    if min_value is not None:
        panel = panel.min(min_value)
    if threshold is not None:
        panel = panel.thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED))
    return panel


def single_stat(title: str, unit: str, description: str, *targets: prometheus.Dataquery,
                threshold: Threshold = None, width: int = 6, height: int = 5,
                links: list[grafana.DashboardLink] = ()) -> stat.Panel:
    panel = _common(stat.Panel(), title, unit, description, targets, width, height, threshold, links)
    return panel.graph_mode(common.BigValueGraphMode.NONE).reduce_options(
        common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))


def value_table(title: str, unit: str, description: str, columns: dict[str, tuple[str, str | None]],
                labels: dict[str, str] | None = None, width: int = 24, height: int = 7,
                links: list[grafana.DashboardLink] = ()) -> table.Panel:
    """One instant query per value column, `columns`: ref id -> (PromQL, column title, None to hide
    it), merged into one row per labelset; `labels` renames label columns. Each query is wrapped in
    `max without ()`, which keeps every label but the metric name: rows of different metrics with
    the same labels then merge."""
    targets = [query(f"max without () ({expr})", ref_id=ref, instant=True) for ref, (expr, _) in columns.items()]
    panel = _common(table.Panel(), title, unit, description, targets, width, height, None, links)
    value_column = {ref: "Value" if len(columns) == 1 else f"Value #{ref}" for ref in columns}
    hide = [*TIME_COLUMNS, *(value_column[ref] for ref, (_, name) in columns.items() if name is None)]
    rename = {**{value_column[ref]: name for ref, (_, name) in columns.items() if name}, **(labels or {})}
    return (panel.with_transformation(model.DataTransformerConfig(id_val="merge", options={}))
            .with_transformation(model.DataTransformerConfig(id_val="organize", options={
                "excludeByName": {name: True for name in hide}, "renameByName": rename})))


def override_unit(panel, column: str, unit: str):
    return panel.override_by_name(column, [model.DynamicConfigValue(id_val="unit", value=unit)])


def override_links(panel, column: str, links: list[grafana.DashboardLink]):
    return panel.override_by_name(column, [model.DynamicConfigValue(
        id_val="links", value=[item.build() for item in links])])


def override_threshold(panel, ref_id: str, value: float):
    """A second threshold for one query's series (e.g. swap-out beside swap-in)."""
    return panel.override_by_query(ref_id, [model.DynamicConfigValue(
        id_val="thresholds", value=threshold_steps(value).build())])


def new_dashboard(title: str, uid: str, description: str, gpu_multi: bool,
                  links: list[grafana.DashboardLink], inference: bool = False) -> grafana.Dashboard:
    return (grafana.Dashboard(title).uid(uid).tags(TAGS)
            .description(f"{description} Generated by `python -m hybridmon.dashboards.generate`; do not edit.")
            .time("now-1h", "now").refresh("30s").tooltip(model.DashboardCursorSync.CROSSHAIR)
            .variables(variables(gpu_multi, inference)).links(links))


def assemble(dashboard: grafana.Dashboard, sections: list[tuple[str | grafana.Row, list]]) -> model.Dashboard:
    """One row per (title or row, panels), then build and number the panels in order (Grafana keys
    panel state and links by id)."""
    for row, panels in sections:
        dashboard = dashboard.with_row(grafana.Row(row) if isinstance(row, str) else row)
        for panel in panels:
            dashboard = dashboard.with_panel(panel)
    built = dashboard.build()
    for number, panel in enumerate(built.panels or [], start=1):
        panel.id_val = number
    return built
