"""Documentation that is generated or promised must match the code."""
import re
from pathlib import Path

from hybridmon.agent import metric_docs
from hybridmon.agent.config import AgentConfig, tomllib
from hybridmon.agent.wiring import COLLECTOR_NAMES

REPO = Path(__file__).resolve().parent.parent


def test_metrics_doc_is_current():
    assert (REPO / "docs" / "metrics.md").read_text() == metric_docs.render(), (
        "run: python -m hybridmon.agent.metric_docs > docs/metrics.md"
    )


def test_every_collector_is_documented_once():
    documented = [c.name for c in metric_docs.collector_classes()]
    assert sorted(documented) == sorted(COLLECTOR_NAMES)


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
