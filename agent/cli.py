"""The `hybridmon` command."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from agent import __version__
from agent.config import ConfigError, load_config, parse_listen
from agent.trace import TraceError

log = logging.getLogger("hybridmon")

EXIT_OK, EXIT_USAGE, EXIT_RUNTIME = 0, 2, 1


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        config = load_config(args.config, overrides=_overrides(args))
    except ConfigError as error:
        print(f"hybridmon: {error}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.handler(args, config)
    except (TraceError, OSError, ValueError) as error:
        print(f"hybridmon: {error}", file=sys.stderr)
        return EXIT_RUNTIME


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridmon", description="Observability agent for hybrid GPU/CPU inference hosts.")
    parser.add_argument("--version", action="version", version=f"hybridmon {__version__}")
    commands = parser.add_subparsers(dest="command")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML configuration file (optional)")
    common.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    common.add_argument("--procfs", metavar="DIR", help="procfs root (default /proc)")
    common.add_argument("--sysfs", metavar="DIR", help="sysfs root (default /sys)")

    run = commands.add_parser("run", parents=[common], help="sample the host and serve /metrics")
    run.add_argument("--listen", metavar="HOST:PORT", help="default 127.0.0.1:9787")
    run.add_argument("--replay", metavar="TRACE", help="read the host from a recorded trace instead")
    run.add_argument("--speed", type=float, default=1.0, help="replay speed factor (0: as fast as possible)")
    run.set_defaults(handler=_run)

    check = commands.add_parser("check", parents=[common], help="one-shot health check with an exit code")
    check.add_argument("--duration", type=float, default=10.0, metavar="SECONDS", help="sampling window (default 10)")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument("--strict", action="store_true", help="info findings (configuration risks) exit 1 too")
    check.set_defaults(handler=_check)

    record = commands.add_parser("record", parents=[common], help="record what the collectors read into a trace")
    record.add_argument("--duration", type=float, required=True, metavar="SECONDS")
    record.add_argument("--output", required=True, metavar="FILE", help="trace file (gzip JSON lines)")
    record.set_defaults(handler=_record)

    bench = commands.add_parser("bench", parents=[common], help="measure host<->device copy bandwidth per GPU")
    bench.add_argument("--gpu", type=int, metavar="N", help="only this GPU (NVML index; default: every GPU)")
    bench.add_argument("--json", action="store_true", help="print the stored runs as JSON")
    bench.add_argument("--force", action="store_true", help="run even while the GPU is in use")
    bench.add_argument("--binary", metavar="PATH", help="a prebuilt offload_bench (default: build with nvcc)")
    bench.add_argument("--no-remote", action="store_true", help="skip the second run on a remote NUMA node")
    bench.add_argument("--max-seconds", type=float, metavar="S", help="time limit per NUMA placement")
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
    return parser


def _overrides(args: argparse.Namespace) -> dict:
    return {
        "log_level": args.log_level,
        "listen": getattr(args, "listen", None),
        "paths.procfs": args.procfs,
        "paths.sysfs": args.sysfs,
    }


class _StopSignals:
    """SIGTERM and SIGINT set an event; installed before uvicorn so its re-raise lands here."""

    def __init__(self) -> None:
        self.event = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        self.event.set()


def _run(args: argparse.Namespace, config) -> int:
    from agent.daemon import Agent
    from agent.server import bind_socket, serve

    if args.speed < 0:
        raise ValueError("--speed must be 0 (as fast as possible) or positive")
    if args.speed != 1.0 and not args.replay:
        raise ValueError("--speed applies to --replay only")
    host, port = parse_listen(config.listen)
    stop = _StopSignals()
    agent = Agent(config, replay_from=args.replay)
    sock = bind_socket(host, port)
    agent.start(replay_speed=args.speed)
    log.info("hybridmon %s (%s) serving http://%s:%d/metrics", __version__, agent.mode, host, port)
    try:
        if not stop.event.is_set():
            serve(agent, sock, config.log_level)
    finally:
        hung = agent.stop()
        sock.close()
    _exit_past_hung_collectors(hung, EXIT_OK)
    return EXIT_OK


def _check(args: argparse.Namespace, config) -> int:
    from agent import check

    if not 1 <= args.duration <= 3600:
        raise ValueError("--duration must be between 1 and 3600 seconds")
    return check.main(config, args.duration, args.json, args.strict)


def _record(args: argparse.Namespace, config) -> int:
    from agent.daemon import Agent

    if args.duration <= 0:
        raise ValueError("--duration must be positive")
    stop = _StopSignals()
    agent = Agent(config, record_to=args.output)
    agent.start()
    log.info("recording for %.0f s into %s", args.duration, args.output)
    stop.event.wait(args.duration)
    hung = agent.stop()
    if agent.recording_error:
        print(f"hybridmon: {agent.recording_error}", file=sys.stderr)
        code = EXIT_RUNTIME
    else:
        log.info("trace written to %s", args.output)
        code = EXIT_OK
    _exit_past_hung_collectors(hung, code)
    return code


def _bench(args: argparse.Namespace, config) -> int:
    from agent.bench import command

    if args.gpu is not None and args.gpu < 0:
        raise ValueError("--gpu must be a GPU index (0, 1, ...)")
    if args.max_seconds is not None:
        if not 0 < args.max_seconds <= 3600:
            raise ValueError("--max-seconds must be between 0 and 3600")
        config = config.model_copy(update={"bench": config.bench.model_copy(
            update={"max_seconds": args.max_seconds})})
    return command.main(config, args.gpu, args.json, args.force, args.binary, not args.no_remote)


def _budget(args: argparse.Namespace, config) -> int:
    import json

    from agent import budget

    try:
        shape = budget.preset(args.model) if args.model else budget.load_config_json(args.config_json)
        vram_free = budget.parse_bytes(args.vram_free, "free VRAM") if args.vram_free is not None else None
        if args.bandwidth is not None:
            bandwidth, source = budget.parse_bandwidth(args.bandwidth), "--bandwidth"
        else:
            bandwidth, source = budget.measured_bandwidth(config.resolved_state_dir()) or (None, None)
        result = budget.compute(shape, args.context, args.dtype, vram_free, bandwidth, source)
    except budget.BudgetError as error:
        print(f"hybridmon: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(budget.render(result))
    return EXIT_OK


def _exit_past_hung_collectors(hung: list[str], code: int) -> None:
    """Python waits for every worker thread at exit; one stuck in NVML would never return."""
    if hung:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
