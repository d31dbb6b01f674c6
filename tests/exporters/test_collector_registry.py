"""A collector is declared once: its REGISTRATION beside its code, listed in exporters/registry.py,
and the configuration, the wiring, the metrics reference and `hybridmon check` all derive from it."""
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import hybridmon.exporters
from hybridmon.agent.commands import check
from docs import generate as docs_generate
from hybridmon.agent.config import COLLECTOR_NAMES, AgentConfig, ConfigError, load_config
from hybridmon.agent.loop.wiring import build_collectors
from hybridmon.exporters.base import CollectorSettings
from hybridmon.exporters.registry import COLLECTORS, NAMES
from hybridmon.exporters.sources import ReplaySource

REPO = Path(__file__).resolve().parents[2]


def collector_classes_in_exporters() -> set[type]:
    """Every class defined in exporters/ that has the shape of base.Collector."""
    found = set()
    for module_info in pkgutil.iter_modules(hybridmon.exporters.__path__):
        module = importlib.import_module(f"hybridmon.exporters.{module_info.name}")
        for _name, value in inspect.getmembers(module, inspect.isclass):
            if value.__module__ == module.__name__ and all(
                    hasattr(value, attribute) for attribute in ("name", "default_interval_seconds", "metric_specs", "collect")):
                found.add(value)
    return found


def built(config: AgentConfig) -> list:
    """The collectors as a replay builds them: nothing is loaded or read."""
    scheduled = build_collectors(config, lambda _name: ReplaySource(), replay=True)
    for item in scheduled:
        item.collector.close()
    return scheduled


def test_every_collector_in_exporters_is_registered():
    registered = {registration.collector for registration in COLLECTORS}
    unregistered = collector_classes_in_exporters() - registered
    assert not unregistered, f"add a REGISTRATION for {sorted(c.__name__ for c in unregistered)} to exporters/registry.py"
    assert len(registered) == len(COLLECTORS)


def test_names_are_unique_and_dependencies_come_first():
    assert len(set(NAMES)) == len(NAMES)
    for position, registration in enumerate(COLLECTORS):
        assert set(registration.runs_after) <= set(NAMES[:position]), registration.name


def test_the_configuration_knows_exactly_the_registered_collectors():
    assert COLLECTOR_NAMES == NAMES
    every_one_off = load_config(environ={}, overrides={f"collectors.{name}.enabled": False for name in NAMES})
    assert not any(every_one_off.collector(name).enabled for name in NAMES)
    with pytest.raises(ConfigError, match="unknown collector nvidia; known: " + ", ".join(NAMES)):
        load_config(environ={"HYBRIDMON_COLLECTORS__NVIDIA__ENABLED": "false"})


def test_each_collectors_settings_are_the_table_named_like_it():
    settings_tables = {name for name, field in AgentConfig.model_fields.items()
                       if inspect.isclass(field.annotation) and issubclass(field.annotation, CollectorSettings)}
    assert settings_tables == {registration.name for registration in COLLECTORS if registration.settings}
    config = load_config(environ={"HYBRIDMON_GPU__MAX_WORKERS": "3"})
    for registration in COLLECTORS:
        settings = config.collector_settings(registration.name)
        if registration.settings is None:
            assert settings is None
        else:
            assert AgentConfig.model_fields[registration.name].annotation is registration.settings
            assert type(settings) is registration.settings
    assert config.collector_settings("gpu").max_workers == 3


def test_the_wiring_builds_every_registered_collector_in_order():
    config = load_config(environ={})
    scheduled = built(config)
    assert [item.collector.name for item in scheduled] == list(NAMES)
    for item, registration in zip(scheduled, COLLECTORS):
        assert type(item.collector) is registration.collector
        assert item.after == registration.runs_after
        assert item.interval_seconds == max(registration.default_interval_seconds, config.interval_seconds)


def test_a_disabled_collector_is_not_built_and_nobody_waits_for_it():
    config = load_config(environ={"HYBRIDMON_COLLECTORS__GPU__ENABLED": "false",
                                  "HYBRIDMON_COLLECTORS__NUMA__INTERVAL_SECONDS": "7"})
    scheduled = {item.collector.name: item for item in built(config)}
    assert list(scheduled) == [name for name in NAMES if name != "gpu"]
    assert scheduled["process"].after == ()
    assert scheduled["numa"].interval_seconds == 7


def test_the_metrics_reference_documents_exactly_the_registered_collectors():
    documented = re.findall(r"^## `(\w+)` \(every ([\d.]+) s by default\)", docs_generate.metrics(), flags=re.M)
    assert sorted(documented) == sorted((r.name, f"{r.default_interval_seconds:g}") for r in COLLECTORS)


def test_the_check_judges_the_collectors_registered_as_essential():
    essential = {registration.name for registration in COLLECTORS if registration.essential}
    assert essential == {"host_memory", "numa", "process", "pressure"}  # what every Linux host has
    assert set(check.ESSENTIAL_COLLECTORS) == essential
    assert check.MAY_HAVE_NO_DATA == {"pressure"}
    assert set(check.ESSENTIAL_SERIES) == {"host_memory"}
