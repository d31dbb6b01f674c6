from pathlib import Path

import pytest

from hybridmon.exporters.sources import LiveSource
from tests.support.scenario_traces import ScenarioTraces

FIXTURES = Path(__file__).parent / "fixtures"
# A 2-node NUMA host: GPU0 (0000:17:00.0, node 0, AER-capable, full Gen4 x16 link) and GPU1
# (0000:ca:00.0, node 1, link downtrained to Gen3 x8); inference processes 4242 (vllm, on GPU0,
# CPUs on node 0 but most memory on node 1) and 5151 (llama-server, on GPU1). See
# tests/fixtures/README.md for every file.
FIXTURE_HOST = FIXTURES / "host-2node"


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
