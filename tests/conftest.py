"""Shared fixtures; the suite's two speeds (./scripts/test and ./scripts/test --fast) are the
plugin tests/support/fast_loop.py."""
import pytest

from hybridmon.exporters.sources import LiveSource
from tests.support.paths import FIXTURE_HOST
from tests.support.scenario_traces import ScenarioTraces

# fast_loop: --fast and the slow marker; pytester: tests/structure/test_fast_loop.py runs a suite
pytest_plugins = ["tests.support.fast_loop", "pytester"]


@pytest.fixture
def fixture_procfs() -> str:
    return str(FIXTURE_HOST / "proc")


@pytest.fixture
def fixture_sysfs() -> str:
    return str(FIXTURE_HOST / "sys")


@pytest.fixture
def live_source() -> LiveSource:
    return LiveSource()


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden", action="store_true", help="rewrite tests/golden/*.prom from the current output"
    )


@pytest.fixture
def update_golden(request) -> bool:
    return request.config.getoption("--update-golden")


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory) -> ScenarioTraces:
    """Every scenario's trace, generated on first use and replayed once, for the whole session."""
    return ScenarioTraces(tmp_path_factory.mktemp("scenarios"))
