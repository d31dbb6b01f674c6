"""The `hybridmon` command."""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import traceback

from hybridmon import __version__
from hybridmon.agent.config import ConfigError, load_config, parse_listen
from hybridmon.agent.logs import configure_logging
from hybridmon.agent.loop.trace import TraceError
from hybridmon.exporters.registry import NAMES as COLLECTOR_NAMES
from hybridmon.rules.runbook_links import runbook_base_url_argument

log = logging.getLogger("hybridmon")

# Exit codes. `check` keeps 0-3 for what it found (agent/commands/check.py) and `bench` its own 1-6
# (docs/offload-bench.md); everything that is not a result has a code of its own from BSD's
# sysexits.h, so a cron job or CI gate tells a broken invocation from a finding.
EXIT_OK = 0
EXIT_USAGE = 64        # EX_USAGE: a typo, a missing or bad flag, flags that do not go together
EXIT_DATA = 65         # EX_DATAERR: an input file given on the command line is not what it must be
EXIT_SOFTWARE = 70     # EX_SOFTWARE: an internal error (a bug): the traceback is printed
EXIT_IO = 74           # EX_IOERR: the system refused: a taken port, a file that cannot be written
EXIT_CONFIG = 78       # EX_CONFIG: the configuration file or HYBRIDMON_* environment is bad or missing
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141: what a shell shows for `cat` killed by SIGPIPE
EXIT_INTERRUPTED = 128 + signal.SIGINT   # 130: Ctrl-C before the command set its own handler

EXIT_CODES_HELP = """exit codes:
  0   success (check: healthy)
  1   check: a warning finding (with --strict, an info finding too)
  2   check: a critical finding
  3   check: could not read this host (an essential collector failed or was not run)
  1-6 bench: the benchmark's own statuses (3: no GPU, 4: the GPU is in use, 5: MIG mode; docs/offload-bench.md)
  64  usage error: unknown command or flag, bad flag value
  65  bad input file (a trace given to --replay, a corrupt stored benchmark result)
  70  internal error (a bug; please report it with the traceback)
  74  operating-system error (port taken, file not writable)
  78  bad or missing configuration (--config file, HYBRIDMON_* variables)
  141 standard output closed early (`hybridmon ... | head`); nothing is printed about it"""

# Where the references live: generated from the code and checked by the test suite
# (tests/integration/test_docs.py), in the source repository beside this package.
REFERENCES_HELP = """references (in the source repository):
  docs/metrics.md        every metric, its unit and where it is read
  docs/configuration.md  every configuration key and HYBRIDMON_* variable, with its default
  docs/quickstart.md     the three ways to use hybridmon, step by step"""


class _UsageExitParser(argparse.ArgumentParser):
    """argparse exits 2 on a bad invocation, which `check` uses for "critical": exit 64 instead."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_name_unknown_collectors(message)}\n")

    def print_help(self, file=None) -> None:
        # argparse drops write errors here; a closed stdout must end like every other command's.
        (file or sys.stdout).write(self.format_help())


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            code = _main(argv)
        except SystemExit as stop:  # argparse after --help, --version or a usage error
            code = stop.code if isinstance(stop.code, int) else EXIT_OK if stop.code is None else EXIT_USAGE
        # Flushed here, not at interpreter exit, so a closed pipe is seen while it can be handled.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): not an error of ours. Point stdout at /dev/null so the
        # interpreter's own flush at exit cannot complain again, and stay quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


# How long a stopping `run` waits for the collectors still running before it abandons them.
STOP_COLLECTORS_SECONDS = 3.0

# A command's error and its exit code, the first class that matches. The commands raise ValueError
# for flags that do not go together (--speed without --replay).
ERROR_EXIT_CODES = ((ConfigError, EXIT_CONFIG), (TraceError, EXIT_DATA), (OSError, EXIT_IO), (ValueError, EXIT_USAGE))


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if not getattr(args, "needs_config", True):  # rules, dashboards, runbooks: files, not the host
        return _without_config(args)
    try:
        config = load_config(args.config, overrides=_overrides(args))
    except ConfigError as error:
        print(f"hybridmon: {error}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(config.log_level, config.log_format)  # agent/logs.py: one format for every logger
    try:
        return args.handler(args, config)
    except (BrokenPipeError, KeyboardInterrupt):
        raise
    except tuple(kind for kind, _code in ERROR_EXIT_CODES) as error:
        print(f"hybridmon: {error}", file=sys.stderr)
        return next(code for kind, code in ERROR_EXIT_CODES if isinstance(error, kind))
    except Exception:
        if config.log_format == "json":
            # one JSON line, the traceback in its "exception" field, for the log shipper that
            # reads the other lines (agent/logs.py); a bare traceback would be lines it cannot parse
            logging.getLogger("hybridmon").exception(
                "internal error in `hybridmon %s`, please report it with this traceback", args.command)
        else:
            print("hybridmon: internal error, please report it with this traceback:", file=sys.stderr)
            traceback.print_exc()
        return EXIT_SOFTWARE


def _listen_address(text: str) -> str:
    """An argparse type: --listen as parse_listen reads it; anything else is a usage error (a flag
    mistyped), not the configuration error the same value in the file is."""
    try:
        parse_listen(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _number_between(low: float, high: float, unit: str, zero_allowed: bool = False):
    """An argparse type: a finite number in [low, high] (or 0, where 0 has a meaning of its own);
    anything else is a usage error that names the range."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and (low <= value <= high or (zero_allowed and value == 0))):
            allowed = f"0 or {low:g} to {high:g}" if zero_allowed else f"{low:g} to {high:g}"
            raise argparse.ArgumentTypeError(f"{text} is outside {allowed} {unit}".rstrip())
        return value
    return parse


def _whole_number_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is less than {low}")
        return value
    return parse


# Flag bounds. check samples at least one tick of every 1 s collector and at most an hour (a cron
# job, not a daemon); record at least one tick and at most 7 days (the trace grows ~1 MB/min).
# A replay slower than 1/100 of real time turns a 10 min trace into 17 h: surely a typo. The
# benchmark's limit per placement has the bounds of bench.max_seconds.
CHECK_DURATION = _number_between(1, 3600, "seconds")
RECORD_DURATION = _number_between(1, 7 * 86400, "seconds")
REPLAY_SPEED = _number_between(0.01, 1e6, "(0: as fast as possible)", zero_allowed=True)
BENCH_MAX_SECONDS = _number_between(1, 3600, "seconds")


# node_exporter's spelling: --collector.NAME turns a collector on, --no-collector.NAME off; the
# names are the registry's, so a new collector gets its pair of flags without an edit here.
COLLECTOR_FLAG_PREFIXES = ("--collector.", "--no-collector.")
COLLECTOR_SWITCHES_HELP = (
    "--collector.NAME turns collector NAME on, --no-collector.NAME off (the key collectors.NAME.enabled; "
    f"a flag wins over the file and HYBRIDMON_*). NAME: {', '.join(COLLECTOR_NAMES)}")


class _CollectorSwitch(argparse.Action):
    """--collector.NAME (const True) or --no-collector.NAME (const False); both for one name is a
    usage error. Not argparse's mutually exclusive groups: with hidden members they break its usage
    line (an AssertionError in Python 3.11's HelpFormatter)."""

    def __init__(self, option_strings, dest, const, **kwargs):
        super().__init__(option_strings, dest, nargs=0, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) not in (None, self.const):
            name = self.dest.removeprefix("collector.")
            parser.error(f"--collector.{name} and --no-collector.{name} both given; give one")
        setattr(namespace, self.dest, self.const)


def _collector_switches() -> argparse.ArgumentParser:
    """The parent parser of the commands that run collectors (run, check, record)."""
    switches = _UsageExitParser(add_help=False)
    group = switches.add_argument_group("collectors", COLLECTOR_SWITCHES_HELP)
    for name in COLLECTOR_NAMES:
        # One help paragraph lists them all instead of twenty lines.
        for flag, on in ((f"--collector.{name}", True), (f"--no-collector.{name}", False)):
            group.add_argument(flag, dest=f"collector.{name}", action=_CollectorSwitch, const=on, help=argparse.SUPPRESS)
    return switches


def _name_unknown_collectors(message: str) -> str:
    """argparse's "unrecognized arguments: --collector.gpus" says neither that it is a collector
    nor which ones exist."""
    _, found, unrecognized = message.partition("unrecognized arguments: ")
    flags = unrecognized.split() if found else []
    unknown = [flag for flag in flags if flag.startswith(COLLECTOR_FLAG_PREFIXES)]
    if not unknown:
        return message
    if all(flag.split(".", 1)[1] in COLLECTOR_NAMES for flag in unknown):
        # Known names, given before the command or to one that runs no collectors (budget, bench).
        return f"{' '.join(unknown)}: collector flags are options of run, check and record, given after " \
               f"the command (hybridmon run {unknown[0]})"
    names = ", ".join(flag.split(".", 1)[1] for flag in unknown)
    others = [flag for flag in flags if flag not in unknown]
    also = f"; also unrecognized: {' '.join(others)}" if others else ""
    return f"unknown collector {names} ({' '.join(unknown)}); known: {', '.join(COLLECTOR_NAMES)}{also}"


def _parser() -> argparse.ArgumentParser:
    parser = _UsageExitParser(prog="hybridmon", description="Observability agent for hybrid GPU/CPU inference hosts.",
                              epilog=f"{EXIT_CODES_HELP}\n\n{REFERENCES_HELP}", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hybridmon {__version__}")
    commands = parser.add_subparsers(dest="command")

    common = _UsageExitParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file (optional)")
    common.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    common.add_argument("--log-format", choices=["text", "json"], help="json: one JSON object per line (default text)")
    common.add_argument("--procfs", metavar="DIR", help="procfs root (default /proc)")
    common.add_argument("--sysfs", metavar="DIR", help="sysfs root (default /sys)")

    switches = _collector_switches()
    run = commands.add_parser("run", parents=[common, switches], help="sample the host and serve /metrics")
    run.add_argument("--listen", metavar="HOST:PORT", type=_listen_address, help="default 127.0.0.1:9787")
    run.add_argument("--web-config-file", metavar="FILE", help="TLS and basic auth: prometheus/exporter-toolkit's "
                     "web configuration, the file node_exporter's --web.config.file reads")
    run.add_argument("--replay", metavar="TRACE", help="read the host from a recorded trace instead")
    run.add_argument("--speed", type=REPLAY_SPEED, default=1.0, help="replay speed factor, 0.01 to 1e6 (0: as fast as possible)")
    run.set_defaults(handler=_run)

    check = commands.add_parser("check", parents=[common, switches], help="one-shot health check with an exit code",
                                epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("--duration", type=CHECK_DURATION, default=10.0, metavar="SECONDS", help="sampling window, 1 to 3600 (default 10)")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument("--strict", action="store_true", help="info findings (configuration risks) exit 1 too")
    check.set_defaults(handler=_check)

    record = commands.add_parser("record", parents=[common, switches], help="record what the collectors read into a trace")
    record.add_argument("--duration", type=RECORD_DURATION, required=True, metavar="SECONDS", help="1 to 604800")
    record.add_argument("--output", required=True, metavar="FILE", help="trace file (gzip JSON lines)")
    record.set_defaults(handler=_record)

    bench = commands.add_parser("bench", parents=[common], help="measure host<->device copy bandwidth per GPU")
    bench.add_argument("--gpu", type=_whole_number_at_least(0), metavar="N", help="only this GPU (NVML index; default: every GPU)")
    bench.add_argument("--json", action="store_true", help="print the stored runs as JSON")
    bench.add_argument("--force", action="store_true", help="run even while the GPU is in use")
    bench.add_argument("--binary", metavar="PATH", help="a prebuilt offload_bench (default: build with nvcc)")
    bench.add_argument("--no-remote", action="store_true", help="skip the second run on a remote NUMA node")
    bench.add_argument("--max-seconds", type=BENCH_MAX_SECONDS, metavar="S", help="time limit per NUMA placement, 1 to 3600")
    bench.add_argument("--mig-instance", action="store_true", help="on a GPU in MIG mode, measure the one MIG instance CUDA sees and keep it in the run history only (never as the GPU's link capacity)")
    bench.set_defaults(handler=_bench)

    budget = commands.add_parser("budget", parents=[common], help="KV cache size and offload reload cost of a context")
    model = budget.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", metavar="NAME", help="a preset, e.g. llama-3-8b (an unknown name lists them)")
    model.add_argument("--config-json", metavar="PATH", help="a Hugging Face config.json instead of a preset")
    budget.add_argument("--context", type=int, required=True, metavar="TOKENS", help="context length in tokens")
    budget.add_argument("--dtype", metavar="DTYPE", help="KV cache element type: fp16, bf16, fp8, fp32, q8, q4 (default: the model's)")
    budget.add_argument("--bandwidth", metavar="RATE", help="host-to-device bytes/s, e.g. 24GB/s or 24e9 (default: the measured one)")
    budget.add_argument("--vram-free", metavar="BYTES", help="VRAM left for KV cache, e.g. 6GiB or 6e9")
    budget.add_argument("--json", action="store_true", help="machine-readable output")
    budget.set_defaults(handler=_budget)

    # The generated files the package carries (agent/commands/shipped.py), for an install without the
    # generators' dependencies; `python -m hybridmon.rules.generate` and friends regenerate them.
    write_into_help = "folder to write them into (created if missing; files of the same name are replaced)"
    rules = commands.add_parser("rules", help="print the Prometheus rules (or write them with --output)")
    rules.add_argument("--output", metavar="FILE", help="write the rule file here instead of printing it")
    rules.add_argument("--runbook-url-base", metavar="URL", type=runbook_base_url_argument,
                       help="every alert's runbook_url is URL/<AlertName>, e.g. https://runbooks.example.org/hybridmon "
                       "(default: http://<instance>/runbooks/<AlertName>, the agent that raised it, and "
                       "http://127.0.0.1:9787/runbooks/<AlertName> without an instance and for HybridmonAgentDown)")
    rules.set_defaults(handler=_rules, needs_config=False)
    dashboards = commands.add_parser("dashboards", help="write the Grafana dashboards (JSON) into a folder")
    dashboards.add_argument("--output", required=True, metavar="DIR", help=write_into_help)
    dashboards.set_defaults(handler=_dashboards, needs_config=False)
    runbooks = commands.add_parser("runbooks", help="write the runbooks (Markdown, one per alert) into a folder")
    runbooks.add_argument("--output", required=True, metavar="DIR", help=write_into_help)
    runbooks.set_defaults(handler=_runbooks, needs_config=False)
    return parser


def _overrides(args: argparse.Namespace) -> dict:
    switched = vars(args)  # collector.NAME: True, False, or None where no flag was given
    return {
        "log_level": args.log_level,
        "log_format": args.log_format,
        "listen": getattr(args, "listen", None),
        "web_config_file": getattr(args, "web_config_file", None),
        "paths.procfs": args.procfs,
        "paths.sysfs": args.sysfs,
        **{f"collectors.{name}.enabled": switched.get(f"collector.{name}") for name in COLLECTOR_NAMES},
    }


class _StopSignals:
    """SIGTERM and SIGINT set an event; installed before uvicorn so its re-raise lands here.

    SIGHUP is logged and ignored, deliberately not a configuration reload: the listen address, the
    collectors and their threads are built once from the configuration, and a half-applied reload
    is worse than an operator told to restart. Python's default for SIGHUP is to die silently
    (rc 129, no stop, no trace end), which is what a stray `kill -HUP` or a closed terminal did.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)
        signal.signal(signal.SIGHUP, self._ignore_hangup)

    def _handle(self, signum: int, _frame) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        self.event.set()

    @staticmethod
    def _ignore_hangup(_signum: int, _frame) -> None:
        log.warning("received SIGHUP: ignored, hybridmon reads its configuration only at start; "
                    "restart to apply configuration changes")


def _run(args: argparse.Namespace, config) -> int:
    from hybridmon.agent.allocator import cap_malloc_arenas
    from hybridmon.agent.daemon import Agent
    from hybridmon.agent.api.server import bind_socket, listen_url, serve
    from hybridmon.agent.api.web_config import WebConfigFile
    from hybridmon.agent.thread_names import name_threads_in_kernel

    if args.speed != 1.0 and not args.replay:
        raise ValueError("--speed applies to --replay only")
    host, port = parse_listen(config.listen)
    # Read and checked before anything starts: a bad file is a ConfigError (exit 78) naming its key.
    web_config = WebConfigFile(config.web_config_file) if config.web_config_file else None
    cap_malloc_arenas()  # before the first thread starts: agent/allocator.py says why
    name_threads_in_kernel()  # so that `top -H` tells the samplers and collectors apart
    stop = _StopSignals()
    scheme = "https" if web_config is not None and web_config.tls else "http"
    agent = Agent(config, replay_from=args.replay, serves_https=scheme == "https")
    sock = bind_socket(host, port)
    agent.start(replay_speed=args.speed)
    log.info("hybridmon %s (%s) serving %s", __version__, agent.mode, listen_url(host, port, scheme=scheme))
    try:
        if not stop.event.is_set():
            serve(agent, sock, config.log_level, web_config=web_config)
    finally:
        # after the server's graceful 3 s and its 2 s backstop: SIGTERM ends the agent within 10 s
        # whatever a collector is doing (issue 30), under systemd's and Kubernetes' grace periods
        hung = agent.stop(timeout=STOP_COLLECTORS_SECONDS)
        sock.close()
    _exit_past_hung_collectors(hung, EXIT_OK)
    return EXIT_OK


def _check(args: argparse.Namespace, config) -> int:
    from hybridmon.agent.commands import check

    return check.main(config, args.duration, args.json, args.strict)


def _record(args: argparse.Namespace, config) -> int:
    from hybridmon.agent.daemon import Agent

    stop = _StopSignals()
    agent = Agent(config, record_to=args.output)
    agent.start()
    log.info("recording for %.0f s into %s", args.duration, args.output)
    stop.event.wait(args.duration)
    hung = agent.stop()
    if agent.recording_error:
        print(f"hybridmon: {agent.recording_error}", file=sys.stderr)
        code = EXIT_IO
    else:
        log.info("trace written to %s", args.output)
        code = EXIT_OK
    _exit_past_hung_collectors(hung, code)
    return code


def _bench(args: argparse.Namespace, config) -> int:
    from hybridmon.agent.commands import bench as bench_command

    if args.max_seconds is not None:
        config = config.model_copy(update={"bench": config.bench.model_copy(
            update={"max_seconds": args.max_seconds})})
    return bench_command.main(config, args.gpu, args.json, args.force, args.binary, not args.no_remote,
                        mig_instance=args.mig_instance)


def _budget(args: argparse.Namespace, config) -> int:
    import json

    from hybridmon.agent.commands import budget

    try:
        shape = budget.preset(args.model) if args.model else budget.load_config_json(args.config_json)
        vram_free = budget.parse_bytes(args.vram_free, "free VRAM") if args.vram_free is not None else None
        bandwidth, source = (budget.parse_bandwidth(args.bandwidth), "--bandwidth") if args.bandwidth is not None else (None, None)
    except budget.BudgetError as error:  # a flag's value, or the file a flag names
        print(f"hybridmon: {error}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if bandwidth is None:
            bandwidth, source = budget.measured_bandwidth(config.resolved_state_dir()) or (None, None)
    except budget.BudgetError as error:  # the stored benchmark result is corrupt
        print(f"hybridmon: {error}", file=sys.stderr)
        return EXIT_DATA
    try:
        result = budget.compute(shape, args.context, args.dtype, vram_free, bandwidth, source)
    except budget.BudgetError as error:  # --context, --dtype
        print(f"hybridmon: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(budget.render(result))
    return EXIT_OK


def _without_config(args: argparse.Namespace) -> int:
    from hybridmon.agent.commands.shipped import MissingPackageData

    try:
        return args.handler(args)
    except BrokenPipeError:
        raise
    except MissingPackageData as error:
        print(f"hybridmon: {error}", file=sys.stderr)
        return EXIT_SOFTWARE
    except OSError as error:  # an output folder or file that cannot be written
        print(f"hybridmon: {error}", file=sys.stderr)
        return EXIT_IO


def _rules(args: argparse.Namespace) -> int:
    from hybridmon.agent.commands.shipped import rules_text

    text = rules_text(args.runbook_url_base)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as output:
            output.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _dashboards(args: argparse.Namespace) -> int:
    from hybridmon.agent.commands.shipped import DASHBOARDS, shipped_files, write_files

    write_files(args.output, shipped_files(DASHBOARDS))
    return EXIT_OK


def _runbooks(args: argparse.Namespace) -> int:
    from hybridmon.agent.commands.shipped import RUNBOOKS, shipped_files, write_files

    write_files(args.output, shipped_files(RUNBOOKS))
    return EXIT_OK


def _exit_past_hung_collectors(hung: list[str], code: int) -> None:
    """Python waits for every worker thread at exit; one stuck in NVML would never return, nor a
    status page render the server abandoned at shutdown (issue 30: SIGTERM left the agent alive
    65 s). The agent has stopped by then: nothing is left to flush but the logs."""
    stuck = [thread for thread in threading.enumerate()
             if thread is not threading.main_thread() and not thread.daemon and thread.is_alive()]
    if hung or stuck:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
