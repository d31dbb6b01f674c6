"""Documentation that is generated or promised must match the code."""
import importlib
import importlib.util
import re
from pathlib import Path

from docs import generate as docs_generate
from hybridmon.agent.config import AgentConfig, tomllib
from hybridmon.exporters.registry import NAMES as COLLECTOR_NAMES

REPO = Path(__file__).resolve().parents[2]


def test_the_generated_documentation_is_current():
    """docs/metrics.md, the collector lists and the schema's enum, the runbook index."""
    stale = [name for name, text in docs_generate.render().items() if (REPO / name).read_text() != text]
    assert stale == [], "run: python -m docs.generate"


def test_every_collector_is_named_where_the_docs_list_them():
    assert [name for name in COLLECTOR_NAMES if f"`{name}`" not in docs_generate.collector_names()] == []
    assert [name for name in COLLECTOR_NAMES if f"## `{name}`" not in docs_generate.metrics()] == []


def test_a_generated_block_missing_from_its_file_is_named():
    try:
        docs_generate.fill("no block here", "docs/example.md", {"collectors": "x"})
    except ValueError as error:
        assert "docs/example.md" in str(error) and "collectors" in str(error)
    else:
        raise AssertionError("a missing block went unnoticed")


def test_configuration_doc_example_is_a_valid_config():
    text = (REPO / "docs" / "configuration.md").read_text()
    (example,) = re.findall(r"```toml\n(.*?)```", text, flags=re.S)
    parsed = AgentConfig.model_validate(tomllib.loads(example))
    assert parsed == AgentConfig.model_validate({"collectors": {"process_numa": {"interval_seconds": 30}}})


def test_readme_has_the_two_set_up_commands_and_ci_runs_the_test_one():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", readme.split("## Set-up on a fresh machine")[1].split("\n## ")[0], flags=re.S)
    assert [b.strip() for b in blocks] == [
        "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/hybridmon run",
        "./scripts/test",
    ]
    assert "./scripts/test" in (REPO / ".ci" / "run").read_text()


# --- commands, modules and paths the documentation names exist in this layout ---------------------
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*/README.md")),
             *sorted((REPO / "runbooks").glob("*.md")), *sorted((REPO / "tests" / "fixtures").rglob("README.md"))]
OLD_TOP_LEVEL = ("agent", "exporters", "rules", "dashboards", "runbooks")  # now hybridmon.<folder>
OUR_MODULES = ("hybridmon", "tests", "deploy", "benchmarks", "docs", *OLD_TOP_LEVEL)
REPOSITORY_PATH = re.compile(
    r"(?<![\w./-])((?:agent|exporters|rules|dashboards|runbooks|tests|benchmarks|docs|deploy|scripts|hybridmon)/"
    r"[\w./<>*{}-]*)")
DOTTED_NAME = re.compile(r"(?<![\w./-])(hybridmon(?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = ("yml", "yaml", "toml", "json", "service", "md", "conf", "py")


def documents_text() -> list[tuple[str, str]]:
    return [(str(path.relative_to(REPO)), path.read_text()) for path in DOCUMENTS]


def test_documented_python_modules_run_in_this_layout():
    wrong = []
    for where, text in documents_text():
        for module in re.findall(r"python[0-9.]* -m ([\w.]+)", text):
            if module.split(".")[0] not in OUR_MODULES:
                continue  # json.tool, venv, a server's own entry point
            if module.split(".")[0] in OLD_TOP_LEVEL or importlib.util.find_spec(module) is None:
                wrong.append(f"{where}: python -m {module}")
    assert wrong == []


def test_documented_hybridmon_names_exist():
    """`hybridmon.agent.daemon.Agent` and the like: a module, or an attribute of one."""
    wrong = []
    for where, text in documents_text():
        for name in set(DOTTED_NAME.findall(text)):
            if name.rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue  # hybridmon.rules.yml, hybridmon.toml: files
            if not _resolves(name):
                wrong.append(f"{where}: {name}")
    assert sorted(wrong) == []


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for length in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:length]))
        except ImportError:
            continue
        try:
            for attribute in parts[length:]:
                value = getattr(value, attribute)
        except AttributeError:
            return False
        return True
    return False


def test_documented_repository_paths_exist():
    missing = []
    for where, text in documents_text():
        for path in REPOSITORY_PATH.findall(text):
            path = path.rstrip(".").split("::")[0]
            if not any(mark in path for mark in "<>*{}") and not (REPO / path).exists():
                missing.append(f"{where}: {path}")
    assert missing == []
