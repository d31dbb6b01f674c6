"""Exit codes of every `hybridmon` command (issue 11, items 12, 15 and 16): a bad invocation (64), a
bad configuration (78), a bad input file (65), a refusal of the system (74) and a bug (70) each have
their own code, apart from `check`'s 0-3; a closed stdout ends quietly with 141."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from hybridmon.agent import cli
from tests.support.agent_helpers import FIXTURE_ENVIRONMENT, HYBRIDMON, REPO, subprocess_environment

BUDGET = ["budget", "--model", "llama-3-8b", "--context", "12000"]


@pytest.fixture(autouse=True)
def no_hybridmon_environment(monkeypatch):
    """main() reads os.environ: the developer's own HYBRIDMON_* settings must not leak in."""
    for name in list(os.environ):
        if name.startswith("HYBRIDMON_"):
            monkeypatch.delenv(name)


USAGE_ERRORS = [
    ([], "usage: hybridmon"),
    (["chek"], "invalid choice: 'chek'"),
    (["check", "--durration", "5"], "unrecognized arguments: --durration"),
    (["check", "--duration", "0"], "--duration: 0 is outside 1 to 3600 seconds"),
    (["check", "--duration", "nan"], "--duration: nan is outside 1 to 3600 seconds"),
    (["check", "--duration", "soon"], "--duration: 'soon' is not a number"),
    (["record", "--duration", "1e-9", "--output", "x.jsonl.gz"], "--duration: 1e-9 is outside 1 to 604800 seconds"),
    (["record", "--output", "x.jsonl.gz"], "the following arguments are required: --duration"),
    (["run", "--speed", "1e-9"], "--speed: 1e-9 is outside 0 or 0.01 to 1e+06"),
    (["run", "--speed", "inf"], "--speed: inf is outside 0 or 0.01 to 1e+06"),
    (["run", "--speed", "2"], "--speed applies to --replay only"),
    (["bench", "--max-seconds", "0.001"], "--max-seconds: 0.001 is outside 1 to 3600 seconds"),
    (["bench", "--gpu", "-1"], "--gpu: -1 is less than 0"),
    (["budget", "--context", "10"], "one of the arguments --model --config-json is required"),
    ([*BUDGET, "--vram-free", "lots"], "cannot read free VRAM"),
    # issue 30: a mistyped flag is a usage error, not the configuration error (78) it used to be
    (["run", "--listen", "nonsense"], "--listen: 'nonsense' is not HOST:PORT"),
    (["run", "--listen", "127.0.0.1:70000"], "--listen: port 70000 is outside 1-65535"),
    # issue 32: node_exporter's collector switches, named from the registry
    (["check", "--collector.gpus"], "unknown collector gpus (--collector.gpus); known: gpu, host_memory, pressure"),
    (["run", "--no-collector.nvml", "--verbose"], "unknown collector nvml (--no-collector.nvml); known: gpu, "),
    (["run", "--no-collector.nvml", "--verbose"], "; also unrecognized: --verbose"),
    (["record", "--duration", "5", "--output", "x", "--collector.numa", "--no-collector.numa"],
     "--collector.numa and --no-collector.numa both given; give one"),
    (["--no-collector.gpu", "run"], "collector flags are options of run, check and record, given after the command"),
    (["budget", "--model", "llama-3-8b", "--context", "1", "--no-collector.gpu"], "collector flags are options of run, check and record"),
]


@pytest.mark.parametrize("argv, message", USAGE_ERRORS, ids=[" ".join(a) or "no command" for a, _ in USAGE_ERRORS])
def test_a_bad_invocation_exits_64_not_a_check_result(capsys, argv, message):
    assert cli.main(argv) == cli.EXIT_USAGE == 64
    out, err = capsys.readouterr()
    assert message in err and out == ""


CONFIG_ERRORS = [
    ({"HYBRIDMON_INTERVAL_SECONDS": "1e-9"}, "interval_seconds = 1e-09: Input should be greater than or equal to 0.1 (from environment)"),
    ({"HYBRIDMON_PATHS": "x", "HYBRIDMON_PATHS__PROCFS": "/host/proc"}, "HYBRIDMON_PATHS gives paths a value"),
    ({"HYBRIDMON_COLLECTORS__NUMA__INTERVAL_SECONDS": "0.01"}, "collectors.numa.interval_seconds = 0.01"),
]


@pytest.mark.parametrize("environment, message", CONFIG_ERRORS, ids=[next(iter(e)) for e, _ in CONFIG_ERRORS])
def test_a_bad_environment_exits_78_naming_the_key(monkeypatch, capsys, environment, message):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["check", "--duration", "1"]) == cli.EXIT_CONFIG == 78
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", [["run"], ["check"], ["record", "--duration", "5", "--output", "x.jsonl.gz"],
                                     ["bench"], BUDGET], ids=lambda command: command[0])
@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("interval_seconds = 1e-9\n".encode(), "interval_seconds = 1e-09"),
    ('[alerting]\nlabels = { site = "D\xfcsseldorf" }\n'.encode("latin-1"), "is not UTF-8 text"),
], ids=["missing", "too fast", "latin-1"])
def test_every_command_exits_78_on_a_bad_config_file(tmp_path, capsys, command, content, message):
    path = tmp_path / "hybridmon.toml"
    if content is not None:
        path.write_bytes(content)
    assert cli.main([*command, "--config", str(path)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert message in err and str(path) in err and "Traceback" not in err


def test_an_internal_error_exits_70_with_the_traceback(monkeypatch, capsys):
    def broken(_args, _config):
        raise RuntimeError("a bug in a command")

    monkeypatch.setattr(cli, "_budget", broken)
    assert cli.main(BUDGET) == cli.EXIT_SOFTWARE == 70
    err = capsys.readouterr().err
    assert "internal error" in err and "Traceback" in err and "RuntimeError: a bug in a command" in err


@pytest.mark.slow
def test_an_internal_error_with_json_logs_is_one_json_line():
    """In a process of its own: in-process, pytest's log capture keeps the CLI from installing its
    handler (agent/logs.py)."""
    code = ("import sys\n"
            "from hybridmon.agent import cli\n"
            "def broken(_args, _config):\n"
            "    raise RuntimeError('a bug in a command')\n"
            "cli._budget = broken\n"
            f"sys.exit(cli.main({[*BUDGET, '--log-format', 'json']!r}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=REPO, env=subprocess_environment())
    assert result.returncode == cli.EXIT_SOFTWARE, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["level"] == "ERROR" and "internal error in `hybridmon budget`" in record["message"]
    assert "Traceback" in record["exception"] and "RuntimeError: a bug in a command" in record["exception"]


def test_collector_switches_become_enabled_overrides_and_win_over_the_environment(monkeypatch):
    from hybridmon.agent.config import load_config
    from hybridmon.exporters.registry import NAMES

    args = cli._parser().parse_args(["check", "--no-collector.gpu", "--collector.inference", "--no-collector.process_numa"])
    overrides = cli._overrides(args)
    assert {key: value for key, value in overrides.items() if key.startswith("collectors.") and value is not None} == {
        "collectors.gpu.enabled": False, "collectors.inference.enabled": True, "collectors.process_numa.enabled": False}
    assert {key for key in overrides if key.startswith("collectors.")} == {f"collectors.{name}.enabled" for name in NAMES}
    environment = {"HYBRIDMON_COLLECTORS__INFERENCE__ENABLED": "false", "HYBRIDMON_COLLECTORS__NUMA__ENABLED": "false"}
    config = load_config(environ=environment, overrides=overrides)
    assert not config.collector("gpu").enabled and not config.collector("process_numa").enabled
    assert config.collector("inference").enabled  # the flag wins over HYBRIDMON_*
    assert not config.collector("numa").enabled and config.collector("pcie").enabled  # no flag: unchanged


@pytest.mark.parametrize("command", ["run", "check", "record"])
def test_help_lists_every_collector_switch_in_one_paragraph(capsys, command):
    from hybridmon.exporters.registry import NAMES

    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    paragraph = out[out.index("--collector.NAME turns collector NAME on"):]
    assert all(name in paragraph for name in NAMES)
    assert "--no-collector.gpu" not in out  # not twenty lines of flags


def test_help_lists_the_exit_codes(capsys):
    for argv in (["--help"], ["check", "--help"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        for line in ("2   check: a critical finding", "64  usage error", "78  bad or missing configuration",
                     "141 standard output closed early"):
            assert line in out, (argv, line)


def run_hybridmon(*args: str, environment: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(HYBRIDMON + list(args), env=subprocess_environment(environment), cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_no_collector_flag_turns_the_collector_off_in_a_real_check():
    result = run_hybridmon("check", "--duration", "1", "--json", "--no-collector.gpu", environment=FIXTURE_ENVIRONMENT)
    assert result.returncode in (0, 1, 2, 3), result.stderr
    reasons = {entry["detector"]: entry["reason"] for entry in json.loads(result.stdout)["skipped"]}
    assert reasons["gpu_lost"] == "the gpu collector is disabled"


@pytest.mark.slow
def test_a_taken_port_exits_74_and_a_bad_trace_65(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = run_hybridmon("run", "--listen", f"127.0.0.1:{port}", environment=FIXTURE_ENVIRONMENT)
    assert refused.returncode == cli.EXIT_IO == 74, refused.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in refused.stderr and "Traceback" not in refused.stderr
    trace = tmp_path / "notes.txt"
    trace.write_text("not a trace\n")
    bad_trace = run_hybridmon("run", "--replay", str(trace), "--listen", "127.0.0.1:1")
    assert bad_trace.returncode == cli.EXIT_DATA == 65, bad_trace.stderr
    assert "not a hybridmon trace" in bad_trace.stderr and "Traceback" not in bad_trace.stderr


@pytest.mark.slow
def test_a_trace_the_system_will_not_let_be_written_exits_74(tmp_path):
    """Issue 30: `record` into a missing directory exited 65 (a bad input file)."""
    refused = run_hybridmon("record", "--duration", "1", "--output", str(tmp_path / "missing/t.jsonl.gz"),
                            environment=FIXTURE_ENVIRONMENT)
    assert refused.returncode == cli.EXIT_IO == 74, refused.stderr
    assert "cannot write trace" in refused.stderr and "No such file or directory" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args", [BUDGET, ["--help"], ["check", "--duration", "1", "--json"]],
                         ids=["budget", "help", "check"])
def test_a_reader_that_goes_away_ends_the_command_quietly_with_141(args):
    """`hybridmon ... | head`: the reader closes the pipe before anything is written."""
    started = time.monotonic()
    process = subprocess.Popen(HYBRIDMON + list(args), env=subprocess_environment(FIXTURE_ENVIRONMENT),
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    try:
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == cli.EXIT_BROKEN_PIPE == 141, err.decode()
    assert b"Broken pipe" not in err and b"Traceback" not in err and b"Exception ignored" not in err
    assert time.monotonic() - started < 30
