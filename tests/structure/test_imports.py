"""The layers point one way, and a metric's name is written once: read from the source itself (ast),
so a module is checked the moment it exists, without importing it.

The floors, bottom up (issues 12 and 27):
- hybridmon/*.py, the shared facts (PCIe rates, units, generated files): import no subpackage;
- exporters/: the sources and their parsers, and the MetricSpec of every series; import nothing
  from the agent, the rules or the dashboards;
- rules/: the PromQL library; reads nothing of the agent (generate.py, the command that writes the
  rule file from the alert families, is the one exception);
- agent/: its subpackages on floors of their own (AGENT_FLOORS below), each importing only the
  floors under it;
- dashboards/: the top; it reads the floors below.
None of them imports the test-support package `tests`, and no two modules import each other at
module level (a cycle makes the import order decide which one sees the other half-initialised).
"""
from __future__ import annotations

import ast
import importlib
import re
import sys
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# Import package -> the repository folder it is installed from (pyproject.toml's package-dir).
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
TOP_LAYERS = ("hybridmon.agent", "hybridmon.rules", "hybridmon.dashboards")
SUBPACKAGES = tuple(package for package in PACKAGE_DIRS if package != "hybridmon")
RULES_COMMAND = "hybridmon.rules.generate"


@dataclass(frozen=True)
class Import:
    target: str  # the module (or package) named, absolute
    line: int
    module_level: bool  # runs when the importing module is imported (not inside a function)
    type_checking: bool  # under `if TYPE_CHECKING:`: never runs


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool

    @property
    def where(self) -> str:
        return str(self.path.relative_to(REPO))


@cache
def modules() -> dict[str, Module]:
    """Every module of the installed packages, by dotted name."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        root = REPO / folder
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join([package, *parts])
            # A folder under a mapped root belongs to the package only if every level has __init__.py.
            if all((root.joinpath(*parts[:depth]) / "__init__.py").exists() for depth in range(len(parts))):
                found[name] = Module(name, path, is_package)
    return found


@cache
def parsed(module: str) -> ast.Module:
    return ast.parse(modules()[module].path.read_text(), filename=str(modules()[module].path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _absolute(module: Module, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{name}" if name else base


@cache
def imports(module: str) -> tuple[Import, ...]:
    """Every import statement of the module, wherever it sits. `from package import name` names the
    submodule when `name` is one, else the package."""
    info = modules()[module]
    known = modules()
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, node.lineno, module_level, type_checking))
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(info, node.level, node.module)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append(Import(target if target in known else base, node.lineno, module_level,
                                    type_checking))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, module_level, True)
            for child in node.orelse:
                visit(child, module_level, type_checking)
        else:
            inside_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, module_level and not inside_function, type_checking)

    visit(parsed(module), True, False)
    return tuple(found)


def _within(target: str, packages: tuple[str, ...]) -> bool:
    return any(target == package or target.startswith(package + ".") for package in packages)


def members(*packages: str) -> list[str]:
    return [name for name in sorted(modules()) if _within(name, packages)]


def offending_imports(importers: list[str], forbidden: tuple[str, ...], allow_type_checking: bool = False) -> list[str]:
    offences = []
    for name in importers:
        module = modules()[name]
        for statement in imports(name):
            if _within(statement.target, forbidden) and not (allow_type_checking and statement.type_checking):
                offences.append(f"{module.where}:{statement.line} imports {statement.target}")
    return offences


def test_every_package_folder_is_installed():
    """A folder with __init__.py under a mapped root that pyproject.toml does not list would be
    missing from the wheel while every test, run from the checkout, still passes."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    packages = {name for name, module in modules().items() if module.is_package}
    assert packages - listed == set()
    assert listed - packages == set()


def test_exporters_import_nothing_from_the_layers_above():
    assert offending_imports(members("hybridmon.exporters"), TOP_LAYERS) == []


def test_shared_facts_import_no_subpackage():
    root_facts = [name for name in members("hybridmon") if not _within(name, SUBPACKAGES)]
    assert {"hybridmon.pcie_rates", "hybridmon.units"} <= set(root_facts)
    assert offending_imports(root_facts, SUBPACKAGES) == []


def test_rules_read_nothing_of_the_agent_but_the_rule_command():
    library = [name for name in members("hybridmon.rules") if name != RULES_COMMAND]
    assert offending_imports(library, ("hybridmon.agent",)) == []


# The agent's floors, bottom up: a module imports only from its own floor's package and the floors
# under it (type hints included). A new module joins a floor here; a new subpackage takes a floor.
AGENT_FLOORS = (
    ("hybridmon.agent.config", "hybridmon.agent.logs", "hybridmon.agent.allocator",
     "hybridmon.agent.thread_names", "hybridmon.agent.self_metrics", "hybridmon.agent.loop",
     "hybridmon.agent.bench"),
    ("hybridmon.agent.detectors",),
    ("hybridmon.agent.publish",),
    ("hybridmon.agent.alerts",),
    ("hybridmon.agent.daemon", "hybridmon.agent.warmup"),
    ("hybridmon.agent.status",),
    ("hybridmon.agent.api",),
    ("hybridmon.agent.commands",),
    ("hybridmon.agent.cli",),
)


def _floor(module: str) -> int | None:
    for index, floor in enumerate(AGENT_FLOORS):
        if _within(module, floor):
            return index
    return None


def test_every_agent_module_stands_on_a_floor():
    assert [name for name in members("hybridmon.agent") if name != "hybridmon.agent" and _floor(name) is None] == []


def test_the_agent_imports_only_downwards():
    offences = []
    for name in members("hybridmon.agent"):
        here = _floor(name)
        for statement in imports(name):
            there = _floor(statement.target)
            if here is not None and there is not None and there > here:
                offences.append(f"{modules()[name].where}:{statement.line} imports {statement.target} "
                                f"(floor {there} over its own {here})")
    assert offences == []


def test_the_agents_top_level_holds_at_most_15_modules():
    top = [name for name, module in modules().items()
           if name.startswith("hybridmon.agent.") and name.count(".") == 2 and not module.is_package]
    assert len(top) <= 15, sorted(top)


def test_the_installed_code_never_imports_the_test_support():
    assert offending_imports(members(*PACKAGE_DIRS), ("tests",)) == []


def module_level_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for name in modules():
        for statement in imports(name):
            if statement.module_level and not statement.type_checking and statement.target in graph:
                if statement.target != name:
                    graph[name].add(statement.target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = lowest[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for neighbour in sorted(graph[node]):
            if neighbour not in index:
                connect(neighbour)
                lowest[node] = min(lowest[node], lowest[neighbour])
            elif neighbour in on_stack:
                lowest[node] = min(lowest[node], index[neighbour])
        if lowest[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for node in sorted(graph):
            if node not in index:
                connect(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(cycles)


def test_import_cycle_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_no_module_level_import_cycle():
    # Functions that import inside their bodies and imports under TYPE_CHECKING run after every
    # module is loaded (or never), so they are not part of the graph.
    assert import_cycles(module_level_graph()) == []


# --- metric names: declared once, in a MetricSpec; everything else reads SPEC.name ------------------
METRIC_NAME = re.compile(r"hybridmon_[a-z][a-z0-9_]*")
METRIC_NAME_SCANNED = ("hybridmon.agent", "hybridmon.exporters", "hybridmon.rules", "hybridmon.dashboards")


@cache
def declared_metric_names() -> frozenset[str]:
    """The name of every MetricSpec the collectors and the agent declare, read from the objects
    (some names are built, e.g. one per inference latency histogram)."""
    from hybridmon.exporters.base import MetricSpec

    def specs(value, depth=0):
        if isinstance(value, MetricSpec):
            yield value
        elif depth < 3 and isinstance(value, (tuple, list, set, frozenset)):
            for item in value:
                yield from specs(item, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for item in value.values():
                yield from specs(item, depth + 1)

    declaring = [name for name in members("hybridmon.agent", "hybridmon.exporters")
                 if "MetricSpec(" in modules()[name].path.read_text()]
    return frozenset(spec.name for name in declaring
                     for value in vars(importlib.import_module(name)).values() for spec in specs(value))


def is_metric_name(word: str, declared: frozenset[str]) -> bool:
    """A declared name, the start of one (a fragment an f-string completes, a family prefix) or one
    extended (a recording rule's "..._off_gpu_node"): "hybridmon_version" (a JSON key) is none."""
    return any(name.startswith(word) or word.startswith(name + "_") for name in declared)


def _spec_factories(tree: ast.Module) -> set[str]:
    """MetricSpec, and the module's own functions that build one (e.g. `_spec(name, kind, help)`)."""
    factories = {"MetricSpec"}
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    grown = True
    while grown:
        grown = False
        for function in functions:
            if function.name in factories:
                continue
            returns = [node.value for node in ast.walk(function) if isinstance(node, ast.Return) and node.value]
            if any(_calls(value, factories) for value in returns):
                factories.add(function.name)
                grown = True
    return factories


def _callee(call: ast.Call) -> str:
    function = call.func
    return function.id if isinstance(function, ast.Name) else getattr(function, "attr", "")


def _calls(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(child, ast.Call) and _callee(child) in names for child in ast.walk(node))


def _docstrings(tree: ast.Module) -> set[int]:
    """The docstrings, and the attribute docstrings written under a constant: prose, not code."""
    return {id(statement.value)
            for node in ast.walk(tree) if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                               ast.AsyncFunctionDef))
            for statement in node.body
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str)}


def metric_name_literals(tree: ast.Module, declared: frozenset[str]) -> list[tuple[int, str]]:
    """(line, name) of each metric name written as a literal outside a MetricSpec declaration and
    outside docstrings: PromQL, panel queries, recording-rule names, sample lookups."""
    factories = _spec_factories(tree)
    in_declarations = {id(child) for node in ast.walk(tree)
                       if isinstance(node, ast.Call) and _callee(node) in factories for child in ast.walk(node)}
    documentation = _docstrings(tree)
    found = {(node.lineno, name)
             for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and id(node) not in in_declarations and id(node) not in documentation
             for name in _names_to_flag(node.value, declared)}
    return sorted(found)


# Literals that look like metric names and are not: a JSON key of the benchmark's stored runs.
NOT_METRIC_NAMES = frozenset({"hybridmon_version"})


def _names_to_flag(text: str, declared: frozenset[str]) -> list[str]:
    """Every hybridmon_* word of a literal, so a misspelt name is caught too, except the stem of a
    recording rule's name ("gpu:<stem>:avg1m"), which may be derived (a capacity computed from
    several series): there only declared names, their prefixes and extensions count."""
    flagged = []
    for match in METRIC_NAME.finditer(text):
        name = match.group(0)
        if name in NOT_METRIC_NAMES:
            continue
        stem = match.start() > 0 and text[match.start() - 1] == ":"
        if not stem or is_metric_name(name, declared):
            flagged.append(name)
    return flagged


def metric_name_offenders() -> dict[str, list[tuple[int, str]]]:
    return {modules()[name].where: literals for name in sorted(modules())
            if _within(name, METRIC_NAME_SCANNED)
            and (literals := metric_name_literals(parsed(name), declared_metric_names()))}


def test_metric_name_finder_allows_only_declarations_and_prose():
    source = '''"""Reads hybridmon_doc_only."""
def _spec(name, help):
    return MetricSpec(name, help, "gauge")
UP = _spec("hybridmon_up", "1 when up; see hybridmon_other.")
QUERY = f"rate({UP.name}[1m]) / hybridmon_literal"
RECORD = "gpu:hybridmon_up:avg1m"
KEY = {"hybridmon_version": 1}
PART = f"hybridmon_lit{UP.name}"
DERIVED = "process:hybridmon_up_off_node:ratio"
'''
    declared = frozenset({"hybridmon_up", "hybridmon_literal", "hybridmon_other"})
    assert metric_name_literals(ast.parse(source), declared) == [
        (5, "hybridmon_literal"), (6, "hybridmon_up"), (8, "hybridmon_lit"), (9, "hybridmon_up_off_node")]


def test_every_declared_metric_is_found():
    declared = declared_metric_names()
    assert {"hybridmon_gpu_up", "hybridmon_collector_success", "hybridmon_finding_active",
            "hybridmon_inference_time_to_first_token_percentile_seconds"} <= declared


def test_metric_names_come_from_their_specs():
    offenders = metric_name_offenders()
    per_file = Counter({where: len(literals) for where, literals in offenders.items()})
    listing = "\n".join(f"  {where}: {count} (first: line {offenders[where][0][0]}, {offenders[where][0][1]})"
                        for where, count in sorted(per_file.items()))
    assert not offenders, (f"{sum(per_file.values())} metric-name literals outside MetricSpec declarations; "
                           f"write SPEC.name (f\"gpu:{{SPEC.name}}:avg1m\" for a recording rule):\n{listing}")


def test_a_misspelt_metric_name_is_caught_and_a_derived_recording_stem_is_not():
    tree = ast.parse('Q = "rate(hybridmon_gpu_pcie_througput_bytes_per_second[1m])"\n'
                     'R = "gpu:hybridmon_gpu_pcie_link_capacity_bytes_per_second:theoretical"\n')
    assert metric_name_literals(tree, declared_metric_names()) == [
        (1, "hybridmon_gpu_pcie_througput_bytes_per_second")]
