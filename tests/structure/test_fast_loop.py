"""`./scripts/test --fast` (pytest --fast) is the inner loop: it leaves out tests/integration/ and
the tests marked slow, and a test it keeps that starts a process or listens on a socket fails at
once with what to do. Checked on a suite of three tests run inside this process (pytester), so a
change to tests/support/fast_loop.py that lets slow work back into the loop fails here.

The loop's time is measured, not asserted: `./scripts/test --fast` took 32-44 s of wall time on the
2-core AMD EPYC VM (2,060 tests, idle, five runs at 1a05231); the closing note of each change to
the suite's speed records it."""
from __future__ import annotations


# Each test of the small suite checks a part of the plugin from inside: the marker is registered,
# a marked test and an integration test carry it (so --fast leaves both out).
SUITE = {
    "tests/unit/test_quick.py": (
        "def test_quick(request):\n"
        "    assert any(line.startswith('slow:') for line in request.config.getini('markers'))\n"
        "    assert request.node.get_closest_marker('slow') is None\n"),
    "tests/unit/test_spawns.py": (
        "import subprocess, sys\n\n"
        "def test_spawns():\n    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"),
    "tests/unit/test_listens.py": (
        "import socket\n\n"
        "def test_listens():\n    with socket.socket() as server:\n"
        "        server.bind(('127.0.0.1', 0))\n        server.listen()\n"),
    "tests/unit/test_marked.py": (
        "import pytest\n\n@pytest.mark.slow\ndef test_marked(request):\n"
        "    assert request.node.get_closest_marker('slow') is not None\n"),
    "tests/integration/test_whole.py": (
        "def test_whole(request):\n"
        "    assert request.node.get_closest_marker('slow') is not None  # marked by where it lives\n"),
}
PLUGIN = ("-p", "tests.support.fast_loop", "-p", "no:cacheprovider")


def suite(pytester) -> None:
    for name, text in SUITE.items():
        path = pytester.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_fast_runs_the_unit_tests_and_fails_one_that_starts_a_process(pytester):
    suite(pytester)
    result = pytester.runpytest_inprocess("--fast", *PLUGIN, "tests")
    result.assert_outcomes(passed=1, failed=2, deselected=2)
    for test in ("test_spawns.py::test_spawns", "test_listens.py::test_listens"):
        result.stdout.fnmatch_lines([f"*{test} starts a process*mark it @pytest.mark.slow*"])


def test_without_fast_the_slow_and_integration_tests_run(pytester):
    """(The two tests that start a process or listen are left out: in a --fast run of this suite
    the outer guard would refuse them too.)"""
    suite(pytester)
    result = pytester.runpytest_inprocess(*PLUGIN, "-k", "not spawns and not listens", "tests")
    result.assert_outcomes(passed=3, deselected=2)
