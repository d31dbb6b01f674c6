"""The alert families, found once. The agent's detectors, `hybridmon check`, the thresholds file's
schema, the Prometheus rule file and its promtool tests, the runbooks and the tests all come from
FAMILIES: adding an alert is a family module in this package (family.py says what it holds), its
[section] in thresholds.toml, its runbook and its test; nothing here lists it.

A family is each module of this package, or subpackage (memory_growth/, whose other modules are
that family's parts), other than this one and family.py; each must define FAMILY, an AlertFamily
named like the module. The order is the rule file's: the groups in rules.groups.GROUPS order, in
each group its families by section name.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

from pydantic import ValidationError, create_model

from hybridmon.agent.alerts.family import AlertFamily, Section
from hybridmon.agent.detectors.base import Detector
from hybridmon.rules.groups import GROUPS
from hybridmon.rules.model import Group

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PACKAGE = __name__.rpartition(".")[0]
NOT_FAMILIES = frozenset({"catalogue", "family"})


class CatalogueError(Exception):
    """A module of agent/alerts/ is not a family as family.py describes one: the message says how."""


def discover() -> tuple[AlertFamily, ...]:
    """Every family of this package, in the rule file's order."""
    package = importlib.import_module(PACKAGE)
    found = []
    for module_info in pkgutil.iter_modules(package.__path__):
        if module_info.name in NOT_FAMILIES:
            continue
        module = importlib.import_module(f"{PACKAGE}.{module_info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, AlertFamily):
            raise CatalogueError(f"{module.__name__} defines no FAMILY = AlertFamily(...): every module of "
                                 f"agent/alerts/ is an alert family; a family's helper module goes inside "
                                 f"its family's package (as memory_growth/ holds its trend and load)")
        if family.section != module_info.name:
            raise CatalogueError(f"{module.__name__}: its FAMILY's section is {family.section!r}; a family "
                                 f"is named like its module, its thresholds section and its test module")
        if family.group not in GROUPS:
            raise CatalogueError(f"{module.__name__}: its group {family.group.name!r} is not in rules.groups.GROUPS")
        found.append(family)
    return tuple(sorted(found, key=lambda family: (GROUPS.index(family.group), family.section)))


FAMILIES: tuple[AlertFamily, ...] = discover()
DEFAULT_THRESHOLDS_FILE = Path(__file__).resolve().parent / "thresholds.toml"


def _field(family: AlertFamily) -> tuple:
    """A section is required unless every key of it has a default: a family added in a later
    release gives its keys defaults, so a thresholds file copied from an earlier one still loads."""
    try:
        return family.settings, family.settings()
    except ValidationError:
        return family.settings, ...


# The schema of thresholds.toml: one section per family.
Thresholds = create_model(
    "Thresholds", __base__=Section,
    **{family.section: _field(family) for family in FAMILIES},  # type: ignore[call-overload]
)


class ThresholdsError(Exception):
    """The thresholds file is unusable; the message names the file and key."""


def load_thresholds(path: str | Path | None = None):
    path = Path(path) if path else DEFAULT_THRESHOLDS_FILE
    try:
        with path.open("rb") as handle:
            raw = tomllib.load(handle)
    except OSError as error:
        raise ThresholdsError(f"thresholds file {path} cannot be read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ThresholdsError(f"thresholds file {path} is not valid TOML: {error}") from None
    try:
        return Thresholds.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise ThresholdsError(f"thresholds file {path}: {problems}") from None


def family(section: str) -> AlertFamily:
    for candidate in FAMILIES:
        if candidate.section == section:
            return candidate
    raise KeyError(section)


def all_detectors(thresholds) -> list[Detector]:
    """One detector per family that has one (not the rule-only ones), built from its section, in
    catalogue order."""
    built = (family.build_detector(getattr(thresholds, family.section)) for family in FAMILIES)
    return [detector for detector in built if detector is not None]


def all_alertnames() -> list[str]:
    """Every alertname any family raises (one runbook each), sorted."""
    return sorted({name for f in FAMILIES for name in f.alertnames})


def lookback_seconds(thresholds) -> float:
    """The longest span of history any detector reads, plus a minute for its 1-minute averages.
    The throughput-decay baseline is the longest: with the default 2 h window it needs the whole
    of the agent's default 2 h history (history_seconds)."""
    return 60.0 + max(f.lookback_seconds(getattr(thresholds, f.section)) for f in FAMILIES)


def rule_groups(thresholds) -> list[Group]:
    """The Prometheus rule groups: each group's shared recordings, then its families' alerts."""
    return [Group(group.name, (*group.recordings(thresholds),
                               *(alert for f in FAMILIES if f.group == group for alert in f.alerts(thresholds))))
            for group in GROUPS]
