import logging
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hybridmon.exporters.sources import LiveSource, RecordingSource, ReplaySource
from hybridmon.exporters.base import ParseError
from hybridmon.exporters.process import (
    EXITS,
    INFO,
    OOM_KILLED,
    MEMLOCK_LIMIT,
    ProcessCollector,
    ProcessStat,
    format_cmdline,
    parse_boot_time,
    parse_proc_stat,
    tree_roots,
)
from hybridmon.exporters.process_cmdline import (ProcessIdentity, arguments_of, cmdline_label, identify, identity_of,
                                                 readable_model, redact)
from hybridmon.exporters.procfs import ProcessStatus, parse_proc_status
from tests.support.paths import FIXTURE_HOST
from hybridmon.exporters.process import parse_memlock_limit
from tests.support.parser_properties import ParserRow, read

KIB = 1024
VLLM_STAT = (FIXTURE_HOST / "proc/4242/stat").read_text()
VLLM_STATUS = (FIXTURE_HOST / "proc/4242/status").read_text()
VLLM_CMDLINE = "python3 -m vllm.entrypoints.openai.api_server --model meta-llama/Meta-Llama-3-8B-Instruct"
LLAMA_CMDLINE = "/usr/local/bin/llama-server -m /models/qwen2.5-7b-q4.gguf -ngl 0"
# executable, server, model of each: what hybridmon_process_info shows instead of the command line
VLLM_IDENTITY = ("python3", "vllm", "meta-llama/Meta-Llama-3-8B-Instruct")
LLAMA_IDENTITY = ("llama-server", "llamacpp", "qwen2.5-7b-q4.gguf")
FIXTURE_BOOT_TIME = 1795000000
# /proc/stat as a 2-CPU kernel writes it; the fixture tree has none, so tests that need btime add it.
PROC_STAT = f"""\
cpu  11211 0 5015 130044 384 0 91 13 0 0
cpu0 2355 0 3020 67813 145 0 16 5 0 0
cpu1 8856 0 1994 62230 239 0 74 7 0 0
intr 216993 0 0 0 0 0 0 0 0 0 0 0
ctxt 387183
btime {FIXTURE_BOOT_TIME}
processes 7798
procs_running 2
procs_blocked 0
softirq 136825 0 19116 3 1452 44510 0 2 35851 0 35891
"""
START_TIME = "hybridmon_process_start_time_seconds"


# Series of a process identity (its exits), not of one pid: see the exit tests below.
IDENTITY_SERIES = (EXITS, OOM_KILLED)


def per_pid(samples):
    return [s for s in samples if s.spec not in IDENTITY_SERIES]


def as_tuples(samples):
    return [(s.spec.name, s.label_values, s.value) for s in per_pid(samples)]


def process_series(pid, name, resident_kib, swap_kib, locked_kib, pinned_kib,
                   minflt, majflt, cpu_ticks, memlock):
    """The series of one process by default: its thread count and allowed CPUs are [process]
    detail_series series."""
    labels = (str(pid), name)
    return [
        ("hybridmon_process_resident_bytes", labels, resident_kib * KIB),
        ("hybridmon_process_swap_bytes", labels, swap_kib * KIB),
        ("hybridmon_process_locked_bytes", labels, locked_kib * KIB),
        ("hybridmon_process_pinned_bytes", labels, pinned_kib * KIB),
        ("hybridmon_process_minor_faults_total", labels, minflt),
        ("hybridmon_process_major_faults_total", labels, majflt),
        ("hybridmon_process_cpu_seconds_total", labels, cpu_ticks / 100),
        ("hybridmon_process_memlock_limit_bytes", labels, memlock),
    ]


VLLM_SERIES = process_series(4242, "python3", 29360128, 1572864, 0, 4194304, 15234567, 8912,
                             4567890 + 123456, 8388608)
LLAMA_SERIES = process_series(5151, "llama-server", 5382116, 0, 0, 0, 2345678, 1201,
                              987654 + 45678, float("inf"))


# After every process's series, its identity: why it is watched and the root of its tree. Neither
# fixture process's parent (4200, 1) is watched: each is the root of its own tree.
VLLM_INFO = [(INFO.name, ("4242", "python3", *VLLM_IDENTITY, "config", "4242"), 1)]
LLAMA_INFO = [(INFO.name, ("5151", "llama-server", *LLAMA_IDENTITY, "config", "5151"), 1)]


def without_start_time(samples):
    return [t for t in as_tuples(samples) if t[0] != START_TIME]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FailingSource(LiveSource):
    """Raises a given OSError for paths ending in a given suffix, as /proc does."""

    def __init__(self, suffix: str, error: OSError) -> None:
        self.suffix, self.error = suffix, error

    def read_text(self, path: str) -> str:
        if path.endswith(self.suffix):
            raise self.error
        return super().read_text(path)


@pytest.fixture
def procfs_copy(tmp_path) -> Path:
    """A private copy of the fixture /proc, with the /proc/stat that holds btime."""
    shutil.copytree(FIXTURE_HOST / "proc", tmp_path / "proc", symlinks=True)
    (tmp_path / "proc/stat").write_text(PROC_STAT)
    return tmp_path / "proc"


def fixture_collector(source, procfs, **overrides):
    arguments = dict(names=["llama-server"], cmdline_patterns=[r"vllm\.entrypoints"], clock_ticks_per_second=100)
    arguments.update(overrides)
    return ProcessCollector(source, procfs=str(procfs), **arguments)


# --- parsers ---------------------------------------------------------------------------------

def test_parse_proc_stat_fixture():
    assert parse_proc_stat(VLLM_STAT) == ProcessStat(
        pid=4242, comm="python3", parent_pid=4200, minor_faults=15234567, major_faults=8912, user_ticks=4567890,
        system_ticks=123456, start_ticks=1234500, state="S",
    )


def test_parse_proc_stat_comm_with_spaces_and_parentheses_ends_at_the_last_one():
    stat = parse_proc_stat(VLLM_STAT.replace("(python3)", "(a) b (c) 5 6)"))
    assert stat.comm == "a) b (c) 5 6"
    assert (stat.minor_faults, stat.major_faults, stat.start_ticks) == (15234567, 8912, 1234500)


@pytest.mark.parametrize("text", [
    "",
    "4242 python3 S 4200",
    "4242 (python3) S 4200 4242",
    "abc " + VLLM_STAT[5:],
    VLLM_STAT.replace(" 15234567 ", " many "),
    ")(" + VLLM_STAT,
])
def test_parse_proc_stat_rejects_garbage(text):
    with pytest.raises(ParseError):
        parse_proc_stat(text)


def test_parse_proc_status_fixture():
    assert parse_proc_status(VLLM_STATUS) == ProcessStatus(
        resident_bytes=29360128 * KIB, swap_bytes=1572864 * KIB, locked_bytes=0,
        pinned_bytes=4194304 * KIB, threads=64, allowed_cpus=frozenset(range(8)),
    )


def _status_fields_of_every_line(text: str) -> dict[str, str]:
    """How parse_proc_status read its fields before it scanned for the 7 it uses: every line."""
    fields = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields[key] = value.strip()
    return fields


def _outcome(parse, text):
    try:
        return parse(text)
    except ParseError as error:
        return ParseError, str(error)


_STATUS_LINES = st.lists(st.tuples(
    st.sampled_from(["Name", "VmRSS", "VmSwap", "VmLck", "VmPin", "Threads", "Cpus_allowed_list", "State",
                     " VmRSS", "VmRSSx", "Vm"]),
    st.sampled_from([":", ": ", ":\t", ""]),
    st.sampled_from(["5 kB", "  7 kB ", "0-3,8", "12", "x", "5 MB", "", "1:2"]),
    st.sampled_from(["\n", "\r\n", "\r", "\x85", "\n\n", ""]),
), max_size=12)


@given(_STATUS_LINES)
def test_parse_proc_status_reads_what_splitting_every_line_read(lines):
    """The scan for the used lines gives what a dict of every line gave, on any line breaks."""
    text = "".join(key + colon + value + end for key, colon, value, end in lines)
    fields = _status_fields_of_every_line(text)
    expected = _outcome(parse_proc_status, "".join(f"{key}:\t{value}\n" for key, value in fields.items()))
    assert _outcome(parse_proc_status, text) == expected


def test_parse_proc_status_of_a_kernel_thread_has_no_memory():
    status = parse_proc_status("Name:\tkthreadd\nState:\tS (sleeping)\nThreads:\t1\nCpus_allowed_list:\t0-15\n")
    assert status == ProcessStatus(threads=1, allowed_cpus=frozenset(range(16)))


@pytest.mark.parametrize("text", [
    "",
    "VmRSS:\t5 kB\n",
    "Name:\tx\nVmRSS:\tlots kB\n",
    "Name:\tx\nVmRSS:\t5 MB\n",
    "Name:\tx\nThreads:\tsome\n",
    "Name:\tx\nCpus_allowed_list:\tz\n",
])
def test_parse_proc_status_rejects_garbage(text):
    with pytest.raises(ParseError):
        parse_proc_status(text)


def test_parse_boot_time():
    assert parse_boot_time(PROC_STAT) == FIXTURE_BOOT_TIME
    with pytest.raises(ParseError, match="no btime"):
        parse_boot_time("cpu  1 2 3\n")
    with pytest.raises(ParseError, match="bad btime"):
        parse_boot_time("btime soon\n")


def test_format_cmdline():
    assert format_cmdline((FIXTURE_HOST / "proc/5151/cmdline").read_text()) == LLAMA_CMDLINE
    assert format_cmdline("") == ""  # kernel threads and zombies


# That any text raises only ParseError: tests/exporters/test_parsers_robustness.py. Here, that this does.
def test_parse_proc_status_refuses_a_cpu_list_longer_than_int_accepts():
    with pytest.raises(ParseError):
        parse_proc_status("Name:\tx\nCpus_allowed_list:\t0-" + "9" * 5000 + "\n")


# --- command line label -----------------------------------------------------------------------

def argv(*arguments: str) -> str:
    return "\0".join(arguments) + "\0"


# Every case issue 11 names, and the shapes around them; "old" marks those the old redaction missed.
# -p and -k: a password or key in sshpass, mysql, openssl; llama.cpp's -p is the prompt (user data
# too), TGI's the port (a detail lost on purpose).
@pytest.mark.parametrize("raw, label", [
    (argv("vllm", "serve", "m", "--api-key", "sk-live-123", "--port", "8000"),
     "vllm serve m --api-key <redacted> --port 8000"),
    (argv("vllm", "serve", "--api-key=sk-live-123", "--hf-token", "hf_abc"),
     "vllm serve --api-key=<redacted> --hf-token <redacted>"),
    (argv("srv", "--DB-Password", "a secret with spaces", "-v"), "srv --DB-Password <redacted> -v"),
    (argv("srv", "--client-secret=x=y", "--AUTH", "-dash-first", "--cookie", "--verbose"),
     "srv --client-secret=<redacted> --AUTH <redacted> --cookie --verbose"),
    (argv("srv", "--credentials-file", "/etc/creds.json", "--ssl-keyfile", "/etc/k.pem"),
     "srv --credentials-file <redacted> --ssl-keyfile <redacted>"),
    # A process that rewrote its title shows the whole command line as one argument.
    ("vllm serve m --api-key sk-live-123 --port 8000\0\0\0", "vllm serve m --api-key <redacted> --port 8000"),
    (argv("llama-server", "--api-key"), "llama-server --api-key"),  # nothing after it to hide
    (argv("python3", "-m", "vllm", "--model", "m", "--key-value=x"), "python3 -m vllm --model m --key-value=<redacted>"),
    # old: env-style assignments
    (argv("sh", "-c", "HF_TOKEN=hf_abc FOO_KEY=k1 AWS_SECRET_ACCESS_KEY=k2 CUDA_VISIBLE_DEVICES=0 vllm serve m"),
     "sh -c HF_TOKEN=<redacted> FOO_KEY=<redacted> AWS_SECRET_ACCESS_KEY=<redacted> CUDA_VISIBLE_DEVICES=0 vllm serve m"),
    (argv("keyd", "key=value", "token"), "keyd key=<redacted> token"),
    (argv("run", "model.api_key=abc", "db.password=x", "--lr=0.1"), "run model.api_key=<redacted> db.password=<redacted> --lr=0.1"),
    # old: URL user-info, wherever the URL is; secret query parameters (signed URLs)
    (argv("llama-server", "-mu", "https://user:pass@host/m.gguf"), "llama-server -mu https://<redacted>@host/m.gguf"),
    (argv("srv", "--model=https://u:p@ss@host/x?sig=abc&X-Amz-Credential=c&page=2"),
     "srv --model=https://<redacted>@host/x?sig=<redacted>&X-Amz-Credential=<redacted>&page=2"),
    (argv("srv", "DATABASE_URL=postgres://admin:hunter2@db:5432/x"), "srv DATABASE_URL=postgres://<redacted>@db:5432/x"),
    # old: short options -p and -k, --pass and --pwd
    (argv("sshpass", "-p", "hunter2", "ssh", "host"), "sshpass -p <redacted> ssh host"),
    (argv("openssl", "enc", "-k", "hunter2", "-in", "f"), "openssl enc -k <redacted> -in f"),
    (argv("srv", "-p=hunter2", "-k", "-v"), "srv -p=<redacted> -k <redacted>"),  # -v may be the key
    (argv("srv", "--pass", "hunter2", "--pwd=hunter3", "-pp", "2"), "srv --pass <redacted> --pwd=<redacted> -pp 2"),
    (argv("llama-server", "-p", "my private prompt", "-ngl", "99"), "llama-server -p <redacted> -ngl 99"),
    # old: bearer tokens and secret headers
    (argv("curl", "-H", "Authorization: Bearer abc.def", "http://h"), "curl -H Authorization: Bearer <redacted> http://h"),
    (argv("srv", "--header", "X-Api-Key: k123", "bearer", "t0k"), "srv --header X-Api-Key: <redacted> bearer <redacted>"),
    # old: well-known token shapes, wherever they are
    (argv("srv", "--model", "org/m", "hf_" + "a1" * 17), "srv --model org/m <redacted>"),
    (argv("srv", "--openai=sk-proj-" + "x" * 24, "ghp_" + "Z9" * 18), "srv --openai=<redacted> <redacted>"),
    (argv("srv", "AKIAIOSFODNN7EXAMPLE", "--s3=s3://AKIAIOSFODNN7EXAMPLE@b"), "srv <redacted> --s3=s3://<redacted>@b"),
    (argv("srv", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.sig"), "srv <redacted>"),
    # what stays: the model, the port, other options
    (argv("text-generation-launcher", "--model-id", "bigscience/bloom", "--port", "8080", "--max-batch-prefill-tokens", "4096"),
     "text-generation-launcher --model-id bigscience/bloom --port 8080 --max-batch-prefill-tokens <redacted>"),
    ("", ""),
])
def test_cmdline_label_redacts_secrets(raw, label):
    assert cmdline_label(raw) == label


def test_cmdline_label_is_cut_to_200_characters_after_redaction():
    raw = argv("srv", "--api-key", "s" * 300, *(["--model", "m" * 50] * 5))
    label = cmdline_label(raw)
    assert len(label) == 200 and "sss" not in label
    assert label.startswith("srv --api-key <redacted> --model " + "m" * 50)


@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\0"), max_size=12), max_size=8),
       st.sampled_from(["--api-key", "--hf-token", "--Password", "--auth", "--pass", "--pwd", "-p", "-k",
                        "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"]),
       st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_.", min_size=12, max_size=24))
def test_a_secret_never_reaches_the_label(before, name, secret):
    assume(secret not in " ".join(before))
    # Options as `--name value` and `--name=value`; env-style assignments as NAME=value only.
    forms = [[f"{name}={secret}"]] + ([[name, secret]] if name.startswith("-") else [])
    for tail in forms:
        assert secret not in " ".join(redact(argv(*before, *tail).split("\0")))


@pytest.mark.parametrize("raw, identity", [
    (argv("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "meta-llama/Meta-Llama-3-8B-Instruct"),
     ("python3", "vllm", "meta-llama/Meta-Llama-3-8B-Instruct")),
    (argv("/home/alice/venv/bin/vllm", "serve", "/home/alice/.cache/huggingface/hub/models--Qwen--Qwen2.5-7B/snapshots/a1b2/",
          "--api-key", "s3cret"), ("vllm", "vllm", "Qwen/Qwen2.5-7B")),
    (argv("vllm", "serve", "/srv/weights/llama-70b", "--served-model-name", "llama", "llama-alias"),
     ("vllm", "vllm", "llama")),  # the name clients ask for, which vLLM's metrics label too
    ("VLLM::EngineCore" + "\0" * 40, ("VLLM::EngineCore", "vllm", "")),  # the engine subprocess's title
    (argv("python3", "-m", "sglang.launch_server", "--model-path", "/home/bob/models/DeepSeek-V3", "--tp", "8"),
     ("python3", "sglang", "DeepSeek-V3")),
    (argv("/usr/local/bin/llama-server", "-m", "/models/qwen2.5-7b-q4.gguf", "-ngl", "0"),
     ("llama-server", "llamacpp", "qwen2.5-7b-q4.gguf")),
    (argv("llama-server", "-hf", "ggml-org/gemma-3-1b-it-GGUF", "-a", "gemma"), ("llama-server", "llamacpp", "gemma")),
    (argv("llama-server", "--model-url", "https://user:pass@host.example:8443/m.gguf?token=t"),
     ("llama-server", "llamacpp", "https://host.example:8443/m.gguf")),
    (argv("text-generation-launcher", "--model-id", "bigscience/bloom-560m", "-p", "8080"),
     ("text-generation-launcher", "tgi", "bigscience/bloom-560m")),
    (argv("text-generation-server", "serve", "bigscience/bloom-560m", "--sharded"),
     ("text-generation-server", "tgi", "bigscience/bloom-560m")),
    (argv("/usr/bin/ollama", "runner", "--model", "/root/.ollama/models/blobs/sha256-6a0746a1ec1a", "--port", "41625"),
     ("ollama", "ollama", "sha256-6a0746a1ec1a")),
    (argv("/usr/bin/ollama", "serve"), ("ollama", "ollama", "")),
    (argv("python3", "train.py", "-m", "/home/carol/secret-project/ckpt"), ("python3", "", "")),  # python's -m
    (argv("python3", "bench.py", "--model=./runs/hf_" + "x" * 30), ("python3", "", "<redacted>")),
    ("", ("", "", "")),
])
def test_identity_names_executable_server_and_model_without_the_line(raw, identity):
    assert identify(arguments_of(raw)) == ProcessIdentity(*identity)


@pytest.mark.parametrize("raw, offloaded", [
    # vLLM and SGLang: --cpu-offload-gb N, GiB per GPU (EngineArgs / ServerArgs; both pass
    # N * 1024**3 to set_cpu_offload_max_bytes), written either way argparse accepts
    (argv("vllm", "serve", "meta-llama/Llama-3.1-70B", "--cpu-offload-gb", "12"), 12 * 1024 ** 3),
    (argv("python3", "-m", "sglang.launch_server", "--model-path", "m", "--cpu-offload-gb=2.5"), 2.5 * 1024 ** 3),
    (argv("vllm", "serve", "m", "--cpu-offload-gb", "4", "--cpu-offload-gb", "0"), None),  # the last wins: off
    (argv("vllm", "serve", "m", "--cpu-offload-gb", "lots"), None),   # argparse would have refused it
    (argv("vllm", "serve", "m", "--cpu-offload-gb", "inf"), None),
    (argv("vllm", "serve", "m", "--kv-offloading-size", "64"), None),  # KV, not weights
    # another program's option of the same name is not a server's evidence
    (argv("python3", "train.py", "--cpu-offload-gb", "12"), None),
])
def test_weight_offload_is_read_from_the_servers_own_option(raw, offloaded):
    assert identify(arguments_of(raw)).weights_offload_bytes == offloaded


def test_every_default_cmdline_pattern_is_a_known_server_family():
    """What the default patterns find, identify() names: one family each, from SERVERS."""
    from hybridmon.exporters.process import DEFAULT_CMDLINE_PATTERNS
    from hybridmon.exporters.inference_names import SERVERS

    examples = ["python3 -m vllm.entrypoints.openai.api_server", "vllm serve m", "/opt/llama-server -m x",
                "python3 -m sglang.launch_server", "text-generation-launcher", "/usr/bin/ollama runner",
                "/venv/bin/lmcache server --l1-size-gb 100", "python -m lmcache.v1.multiprocess.server"]
    for pattern in DEFAULT_CMDLINE_PATTERNS:
        matched = [line for line in examples if re.search(pattern, line)]
        assert matched, pattern
        for line in matched:
            assert identify(line.split()).server in SERVERS, line


@pytest.mark.parametrize("line", [
    "c++ -O1 -DNDEBUG -o tools/server/CMakeFiles/llama-server.dir/server.cpp.o -c server.cpp",
    "/usr/bin/c++ -O1 CMakeFiles/llama-server.dir/server.cpp.o -o ../../bin/llama-server libllama.a",
    "tail -f /var/log/llama-server.log",
    "vim /etc/systemd/system/llama-server.service",
    "journalctl -fu text-generation-launcher",
    "grep ollama serve /var/log/syslog",
])
def test_default_patterns_leave_out_commands_that_only_mention_a_server(line):
    from hybridmon.exporters.process import DEFAULT_CMDLINE_PATTERNS

    assert not [p for p in DEFAULT_CMDLINE_PATTERNS if re.search(p, line)], line


@pytest.mark.parametrize("line", [
    "llama-server -m /models/q.gguf", "/opt/llama.cpp/build/bin/llama-server --port 8080",
    "/usr/lib/ollama/llama-server --model /root/.ollama/models/blobs/sha256-x --port 41234",
    "text-generation-launcher --model-id m", "/usr/local/bin/text-generation-router --port 3000",
    "/usr/local/bin/ollama serve", "ollama runner --model /root/.ollama/models/blobs/sha256-x",
])
def test_default_patterns_find_servers_by_their_command(line):
    from hybridmon.exporters.process import DEFAULT_CMDLINE_PATTERNS

    assert [p for p in DEFAULT_CMDLINE_PATTERNS if re.search(p, line)], line


@pytest.mark.parametrize("value, readable", [
    ("/home/alice/models/x.gguf", "x.gguf"),
    ("~/m/", "m"),
    ("../weights/llama", "llama"),
    ("meta-llama/Llama-3-8B", "meta-llama/Llama-3-8B"),
    ("https://u:p@h/a/b.gguf#frag", "https://h/a/b.gguf"),
    ("/", "/"),
    ("x" * 300, "x" * 128),
    # issue 30: user-info without "://", and after a scheme written with a backslash (the WHATWG
    # URL standard reads https:/\ as https://, and so do browsers and curl)
    ("user:SECRET@host/repo", "<redacted>@host/repo"),
    ("https:/\\user:pw@host/m.gguf", "https:/\\<redacted>@host/m.gguf"),
    # URLs urlsplit refuses (ValueError): an unclosed IPv6 bracket, a port out of range or not a
    # number; still no user-info, query or fragment
    ("https://x@[::1", "https://<redacted>@[::1"),
    ("https://u:p@host:99999/m.gguf?sig=s", "https://<redacted>@host:99999/m.gguf"),
    ("https://host:port/m#f", "https://host:port/m"),
])
def test_readable_model_shows_no_home_directory_or_credentials(value, readable):
    assert readable_model(value) == readable


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.text(max_size=40),
    # URL-like words, where urlsplit's errors live: brackets, ports, schemes, user-info
    st.builds(lambda scheme, middle, tail: f"{scheme}{middle}{tail}",
              st.sampled_from(["https://", "http:/\\", "hf://", "s3://", "", "file:"]),
              st.text(alphabet="[]:@/\\?#%.x9", max_size=12), st.text(max_size=8)),
    st.sampled_from(["--model", "-m", "--model-url", "--served-model-name", "--cpu-offload-gb", "serve",
                     "vllm", "llama-server", "-hf"])), max_size=10),
    st.sampled_from(["llama-server", "vllm", "python3 -m sglang.launch_server", "ollama runner"]))
def test_no_command_line_makes_the_readers_raise(words, program):
    """Issue 30: any local user can start a process with any command line; what the collector
    reads of it (identity_of, cmdline_label) returns for every one of them."""
    raw = argv(*program.split(), *words)
    identity = identity_of(raw)
    assert len(identity.model) <= 128 and len(cmdline_label(raw)) <= 200


def test_a_process_whose_command_line_defeats_a_parser_costs_only_its_own_identity(procfs_copy, monkeypatch,
                                                                                   caplog):
    """Issue 30: `--model 'https://x@[::1'` on a process named llama-server made every collection
    fail: every hybridmon_process_* series went, the real servers' included. Now that URL reads
    (readable_model), and a parser bug still left costs that process its identity only."""
    (procfs_copy / "5151/cmdline").write_bytes(b"llama-server\0--model\0https://x@[::1\0")
    samples = fixture_collector(LiveSource(), procfs_copy).collect()
    [info] = samples.find("hybridmon_process_info", pid="5151")
    assert dict(zip(info.spec.label_names, info.label_values))["model"] == "https://<redacted>@[::1"

    import hybridmon.exporters.process as process_module

    def broken(raw):
        if "llama-server" in raw:
            raise ValueError("Invalid IPv6 URL")
        return identity_of(raw)
    monkeypatch.setattr(process_module, "identity_of", broken)
    samples = fixture_collector(LiveSource(), procfs_copy).collect()
    [info] = samples.find("hybridmon_process_info", pid="5151")   # watched still, in its tree
    assert info.label_values[2:] == ("", "", "", "config", "5151")
    assert samples.value("hybridmon_process_resident_bytes", pid="5151") > 0   # its other series stay
    assert samples.find("hybridmon_process_info", pid="4242")                 # and the others' identity
    assert "cannot read the command line of pid 5151 (ValueError: Invalid IPv6 URL)" in caplog.text


# --- collector on the fixture host ---------------------------------------------------------

def test_collector_on_fixture_host_finds_servers_by_name_and_command_line(live_source, fixture_procfs):
    collector = fixture_collector(live_source, fixture_procfs)
    samples = collector.collect()
    # Start times need btime from /proc/stat, which the shared fixture tree may or may not hold;
    # test_start_time_from_btime checks them.
    assert without_start_time(samples) == VLLM_SERIES + LLAMA_SERIES + VLLM_INFO + LLAMA_INFO
    assert collector.watched() == {4242: "python3", 5151: "llama-server"}
    assert {s.spec for s in samples} <= set(ProcessCollector.metric_specs)


def test_start_time_from_btime(procfs_copy):
    samples = fixture_collector(LiveSource(), procfs_copy).collect()
    assert samples.value(START_TIME, pid="4242") == FIXTURE_BOOT_TIME + 12345.0
    assert samples.value(START_TIME, pid="5151") == FIXTURE_BOOT_TIME + 23456.0


def test_without_proc_stat_start_times_are_absent(procfs_copy, caplog):
    (procfs_copy / "stat").unlink()
    collector = fixture_collector(LiveSource(), procfs_copy)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.process"):
        samples = collector.collect()
        collector.collect()
    assert samples.find(START_TIME) == []
    assert without_start_time(samples) == VLLM_SERIES + LLAMA_SERIES + VLLM_INFO + LLAMA_INFO
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"cannot get btime from {procfs_copy}/stat"]


def test_configured_pid_and_gpu_holders_are_watched_with_their_reason(live_source, fixture_procfs):
    collector = ProcessCollector(live_source, procfs=fixture_procfs, pids=[1], clock_ticks_per_second=100,
                                 gpu_processes=lambda: {5151: "llama-server", 1: "systemd"})
    samples = collector.collect()
    info = {s.label_values[0]: s.label_values[2:-1] for s in samples.find("hybridmon_process_info")}
    assert info == {"1": ("init", "", "", "config"), "5151": (*LLAMA_IDENTITY, "gpu")}
    assert samples.value("hybridmon_process_resident_bytes", pid="1") == 12800 * KIB
    assert collector.watched() == {1: "systemd", 5151: "llama-server"}


def test_failing_gpu_process_list_leaves_the_rest(live_source, fixture_procfs, caplog):
    def broken():
        raise RuntimeError("NVML went away")

    collector = ProcessCollector(live_source, procfs=fixture_procfs, pids=[4242], gpu_processes=broken,
                                 clock_ticks_per_second=100)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.process"):
        samples = collector.collect()
    assert without_start_time(samples) == VLLM_SERIES + VLLM_INFO
    assert any("NVML went away" in r.getMessage() for r in caplog.records)


def test_bad_pattern_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"'vllm\(' is not a valid regular expression"):
        ProcessCollector(LiveSource(), cmdline_patterns=["llama", "vllm("])


def test_discovery_scans_proc_only_every_interval(procfs_copy):
    clock = FakeClock()
    source = RecordingSource(LiveSource())
    collector = fixture_collector(source, procfs_copy, clock=clock, discovery_interval_seconds=10)
    collector.collect()
    assert ["call", "process.discovery"] in [r[:2] for r in source.take_readings()]
    shutil.copytree(procfs_copy / "5151", procfs_copy / "6161")  # a second llama-server starts
    clock.now = 5.0
    samples = collector.collect()
    readings = source.take_readings()
    assert not any(key == "process.discovery" for _, key, *_ in readings)
    assert not any("/6161/" in path for _, path, *_ in readings)
    assert samples.find("hybridmon_process_info", pid="6161") == []
    clock.now = 10.0
    samples = collector.collect()
    assert samples.value("hybridmon_process_resident_bytes", pid="6161") == 5382116 * KIB


def test_a_trace_holds_the_discovery_matches_and_no_other_process(procfs_copy):
    recording = RecordingSource(LiveSource())
    fixture_collector(recording, procfs_copy).collect()
    readings = recording.take_readings()
    [discovery] = [r for r in readings if r[:2] == ["call", "process.discovery"]]
    assert discovery[2:] == [True, {"4242": "cmdline", "5151": "name"}]
    assert not any(kind == "dir" for kind, *_ in readings)
    read = {path.removeprefix(f"{procfs_copy}/") for kind, path, *_ in readings if kind == "text"}
    # self/mountinfo: where the memory cgroup trees are (this fixture has none, so no cgroup files)
    assert read == {"stat", "self/mountinfo"} | {
        f"{pid}/{name}" for pid in (4242, 5151) for name in ("stat", "status", "cmdline", "limits")}
    assert "/sbin/init" not in str(readings)  # pid 1, read by the scan, is not in the trace


class UnlistableSource(LiveSource):
    """The host, except that listing directories fails once `refuse` is set (EMFILE, say)."""

    refuse = False

    def list_dir(self, path: str) -> list[str]:
        if self.refuse:
            raise OSError(24, "Too many open files", path)
        return super().list_dir(path)


def test_unlistable_procfs_keeps_the_processes_found_before(fixture_procfs, caplog):
    clock, host = FakeClock(), UnlistableSource()
    recording = RecordingSource(host)
    collector = fixture_collector(recording, fixture_procfs, clock=clock)
    replay = ReplaySource()
    replayer = fixture_collector(replay, fixture_procfs)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.process"):
        for now, refuse in ((0.0, False), (10.0, True), (20.0, True)):
            clock.now, host.refuse = now, refuse
            recorded = as_tuples(collector.collect())
            replay.load(recording.take_readings())
            assert as_tuples(replayer.collect()) == recorded
            assert {labels[0] for _, labels, _ in recorded} == {"4242", "5151"}
    scan_failures = [r.getMessage() for r in caplog.records if "cannot list" in r.getMessage()]
    assert len(scan_failures) == 2  # once live, once replayed
    assert "Too many open files" in scan_failures[0]


def test_process_that_exits_is_dropped_without_error(procfs_copy, caplog):
    clock = FakeClock()
    source = RecordingSource(LiveSource())
    collector = fixture_collector(source, procfs_copy, clock=clock)
    collector.collect()
    shutil.rmtree(procfs_copy / "4242")
    clock.now = 1.0
    with caplog.at_level(logging.WARNING):
        samples = collector.collect()
    assert {s.label_values[0] for s in per_pid(samples)} == {"5151"}
    assert collector.watched() == {5151: "llama-server"}
    assert caplog.records == []
    source.take_readings()
    clock.now = 2.0
    collector.collect()
    assert not any("/4242/" in path for _, path, *_ in source.take_readings())  # off the list


@pytest.mark.parametrize("error", [
    ProcessLookupError(3, "No such process"),  # read() on a /proc file of a process that just exited
    FileNotFoundError(2, "No such file or directory"),
])
@pytest.mark.parametrize("file", ["status", "cmdline"])
def test_process_exiting_mid_read_leaves_no_partial_series(fixture_procfs, error, file):
    collector = fixture_collector(FailingSource(f"4242/{file}", error), fixture_procfs)
    samples = collector.collect()
    assert samples.find("hybridmon_process_minor_faults_total", pid="4242") == []  # read before it
    assert {s.label_values[0] for s in per_pid(samples)} == {"5151"}


def test_process_of_another_user_gives_what_is_readable(fixture_procfs, caplog):
    denied = PermissionError(13, "Permission denied")
    collector = fixture_collector(FailingSource("5151/status", denied), fixture_procfs)
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.process"):
        samples = collector.collect()
        collector.collect()
    assert samples.value("hybridmon_process_major_faults_total", pid="5151") == 1201
    assert samples.value("hybridmon_process_resident_bytes", pid="5151") is None
    assert samples.find("hybridmon_process_info", pid="5151") != []
    assert without_start_time(samples)[:len(VLLM_SERIES)] == VLLM_SERIES
    messages = [r.getMessage() for r in caplog.records if "5151" in r.getMessage()]
    assert len(messages) == 1 and "5151/status" in messages[0] and "CAP_SYS_PTRACE" in messages[0]


def test_reused_pid_is_dropped_until_the_next_scan(procfs_copy):
    clock = FakeClock()
    collector = fixture_collector(LiveSource(), procfs_copy, clock=clock)
    collector.collect()
    stat = procfs_copy / "5151/stat"
    stat.write_text(stat.read_text().replace(" 2345600 ", " 9999999 "))  # same pid, new process
    clock.now = 1.0
    assert collector.collect().find("hybridmon_process_info", pid="5151") == []


def test_cmdline_and_limits_are_read_once_per_discovery_interval(procfs_copy):
    """stat and status every tick; cmdline and limits, set when a process starts, once per
    discovery interval (10 s) and again as soon as the pid belongs to another process."""
    clock = FakeClock()
    source = RecordingSource(LiveSource())
    collector = fixture_collector(source, procfs_copy, clock=clock)

    def read_files(pid):
        return sorted(path.rsplit("/", 1)[1] for kind, path, *_ in source.take_readings()
                      if kind == "text" and f"/{pid}/" in path)

    collector.collect()
    assert read_files(4242) == ["cmdline", "limits", "stat", "status"]
    limits = procfs_copy / "4242/limits"
    limits.write_text(limits.read_text().replace("Max locked memory         8388608",
                                                 "Max locked memory         65536   "))
    clock.now = 1.0
    samples = collector.collect()
    assert read_files(4242) == ["stat", "status"]
    assert samples.value(MEMLOCK_LIMIT.name, pid="4242") == 8388608
    assert samples.find(INFO.name, pid="4242") != []  # the identity stays exported meanwhile
    clock.now = 10.0
    assert collector.collect().value(MEMLOCK_LIMIT.name, pid="4242") == 65536
    assert read_files(4242) == ["cmdline", "limits", "stat", "status"]
    stat = procfs_copy / "4242/stat"
    stat.write_text(stat.read_text().replace(" 1234500 ", " 9999999 "))  # same pid, a new process
    clock.now = 11.0
    collector.collect()
    assert read_files(4242) == ["cmdline", "limits", "stat", "status"]


def test_garbled_stat_skips_only_that_process(procfs_copy, caplog):
    (procfs_copy / "4242/stat").write_text("garbage\n")
    with caplog.at_level(logging.WARNING, logger="hybridmon.exporters.process"):
        samples = fixture_collector(LiveSource(), procfs_copy).collect()
    assert {s.label_values[0] for s in per_pid(samples)} == {"5151"}
    assert any("4242/stat" in r.getMessage() for r in caplog.records)


# --- this host -----------------------------------------------------------------------------

def test_collector_on_this_host_reads_this_process():
    me = os.getpid()
    collector = ProcessCollector(LiveSource(), pids=[me], detail_series=True)
    samples = collector.collect()
    comm = Path("/proc/self/comm").read_text().strip()
    assert collector.watched() == {me: comm}
    assert samples.value("hybridmon_process_resident_bytes", pid=str(me)) > 1 << 20
    assert samples.value("hybridmon_process_threads", pid=str(me)) >= 1
    assert samples.value("hybridmon_process_allowed_cpus", pid=str(me)) == len(os.sched_getaffinity(0))
    assert samples.value("hybridmon_process_cpu_seconds_total", pid=str(me)) > 0
    assert samples.value("hybridmon_process_minor_faults_total", pid=str(me)) > 0
    started = samples.value(START_TIME, pid=str(me))
    assert time.time() - 24 * 3600 < started <= time.time() + 1
    [info] = samples.find("hybridmon_process_info", pid=str(me))
    argv0 = Path("/proc/self/cmdline").read_text().split("\0")[0]
    assert info.label_values[2] == Path(argv0).name and info.label_values[5] == "config"


def test_collector_on_this_host_discovers_by_name_and_command_line():
    me = os.getpid()
    comm = Path("/proc/self/comm").read_text().strip()
    by_name = ProcessCollector(LiveSource(), names=[comm])
    by_name.collect()
    assert me in by_name.watched()
    by_cmdline = ProcessCollector(LiveSource(), cmdline_patterns=[r"pytest|py\.test|python"])
    by_cmdline.collect()
    assert me in by_cmdline.watched()


# --- record and replay ---------------------------------------------------------------------

def test_record_then_replay_gives_identical_samples(procfs_copy):
    clock = FakeClock()
    recording = RecordingSource(LiveSource())
    gpu = lambda: {5151: "llama-server"}  # noqa: E731
    recorder = ProcessCollector(recording, procfs=str(procfs_copy), cmdline_patterns=[r"vllm\.entrypoints"],
                                gpu_processes=gpu, clock=clock, discovery_interval_seconds=10)
    replay = ReplaySource()
    # The replay runs on its own clock: the recorded clock readings decide when it scans.
    replayer = ProcessCollector(replay, procfs=str(procfs_copy), cmdline_patterns=[r"vllm\.entrypoints"],
                                gpu_processes=gpu, discovery_interval_seconds=10)
    for now in (0.0, 6.0, 12.0):
        clock.now = now
        recorded = as_tuples(recorder.collect())
        replay.load(recording.take_readings())
        assert as_tuples(replayer.collect()) == recorded
        assert len(recorded) == 20   # 10 series each, the tree root a label of the info series
    assert replayer.watched() == recorder.watched() == {4242: "python3", 5151: "llama-server"}


def test_clock_ticks_are_read_once_through_the_source(fixture_procfs):
    source = RecordingSource(LiveSource())
    collector = ProcessCollector(source, procfs=fixture_procfs, pids=[4242])
    collector.collect()
    calls = [r for r in source.take_readings() if r[0] == "call"]
    assert [r[1] for r in calls] == ["process.clock", "os.sysconf(SC_CLK_TCK)", "process.oom_kills"]
    assert calls[1][3] == os.sysconf("SC_CLK_TCK")
    collector.collect()
    assert [r[1] for r in source.take_readings() if r[0] == "call"] == ["process.clock", "process.oom_kills"]


def test_constructor_reads_nothing(fixture_procfs):
    source = RecordingSource(LiveSource())
    ProcessCollector(source, procfs=fixture_procfs, names=["x"], pids=[1])
    assert source.take_readings() == []



def test_pinned_bytes_help_does_not_promise_cuda_pinned_memory():
    from hybridmon.exporters.process import PINNED

    assert "mm->pinned_vm" in PINNED.documentation
    assert "CUDA pinned host memory (cudaHostAlloc, cudaHostRegister) is generally counted in " \
           "neither VmPin nor VmLck" in PINNED.documentation


def test_memlock_limit_is_read_from_limits_with_unlimited_as_infinity(fixture_procfs):
    import math

    from hybridmon.exporters.sources import LiveSource
    from hybridmon.exporters.process import ProcessCollector, parse_memlock_limit

    collector = ProcessCollector(LiveSource(), procfs=fixture_procfs, pids=(4242, 5151))
    samples = collector.collect()
    assert samples.value("hybridmon_process_memlock_limit_bytes", pid="4242") == 8388608.0
    assert samples.value("hybridmon_process_memlock_limit_bytes", pid="5151") == math.inf
    with pytest.raises(ParseError):
        parse_memlock_limit("Max locked memory         lots      lots      bytes\n")
    with pytest.raises(ParseError):
        parse_memlock_limit("Max open files 1024 1024 files\n")


# --- process trees: which server a process belongs to (issue 14 item 1) -----------------------

def test_parse_proc_stat_reads_the_parent_pid_from_field_4():
    # proc(5): "(4) ppid %d The PID of the parent of this process."
    assert parse_proc_stat(VLLM_STAT).parent_pid == 4200
    assert parse_proc_stat(VLLM_STAT.replace("(python3) S 4200", "(a) S (b) S 77")).parent_pid == 77


def test_tree_roots_follow_parents_while_they_are_watched():
    # vLLM V1: API server 100 (parent: a shell, not watched) -> EngineCore 101 -> TP workers 102, 103;
    # a lone llama-server 200 whose parent is not watched; a garbled loop 300 <-> 301 ends.
    parents = {100: 90, 101: 100, 102: 101, 103: 101, 200: 1, 300: 301, 301: 300}
    assert tree_roots(parents) == {100: 100, 101: 100, 102: 100, 103: 100, 200: 200,
                                   300: 301, 301: 300}


def test_a_child_of_a_watched_server_is_tied_to_it(procfs_copy):
    # llama-server's parent becomes the watched vLLM python3 (4242): both are in 4242's tree.
    stat = procfs_copy / "5151/stat"
    pid, rest = stat.read_text().split(") ", 1)
    state, _parent, tail = rest.split(" ", 2)
    stat.write_text(f"{pid}) {state} 4242 {tail}")
    samples = fixture_collector(LiveSource(), procfs_copy).collect()
    roots = {s.label_values[0]: s.label_values[-1] for s in samples.find(INFO.name)}
    assert roots == {"4242": "4242", "5151": "4242"}


# This module's parsers, each with realistic samples, for tests/exporters/test_parsers_robustness.py
# (which holds every parse_* of exporters/ to its one promised error).
PARSER_ROWS = [
    ParserRow(parse_proc_status, read(FIXTURE_HOST / "proc/4242/status")),
    ParserRow(parse_proc_stat, read(FIXTURE_HOST / "proc/4242/stat")),
    ParserRow(parse_boot_time, read(FIXTURE_HOST / "proc/stat")),
    ParserRow(parse_memlock_limit, read(FIXTURE_HOST / "proc/4242/limits")),
]


# --- exits: what stays of a process once it is gone ----------------------------------------------
# The kernel counts an OOM kill (oom_kill of /proc/vmstat, mm/oom_kill.c __oom_kill_process, and of
# the victim's memory cgroup, memcg_memory_event(MEMCG_OOM_KILL)) before the victim exits, so a
# collection that finds the process gone also finds the count risen.

VLLM_IDENTITY_LABELS = ("python3", *VLLM_IDENTITY[1:])
LLAMA_IDENTITY_LABELS = ("llama-server", *LLAMA_IDENTITY[1:])


def exits_of(samples) -> dict[tuple, tuple[float, float]]:
    """identity -> (exits, of them OOM-killed)"""
    return {labels: (value, samples.value(OOM_KILLED.name, process_name=labels[0], server=labels[1],
                                          model=labels[2]))
            for labels, value in ((s.label_values, s.value) for s in samples if s.spec is EXITS)}


def add_oom_kills(procfs: Path, count: int) -> None:
    vmstat = procfs / "vmstat"
    kills = int(re.search(r"^oom_kill (\d+)$", vmstat.read_text(), re.M).group(1))
    vmstat.write_text(re.sub(r"^oom_kill \d+$", f"oom_kill {kills + count}", vmstat.read_text(), flags=re.M))


def two_ticks(procfs: Path, change, **overrides):
    """(first collection, second collection after `change(procfs)`), recorded, and the second
    replayed from its readings."""
    clock = FakeClock()
    source = RecordingSource(LiveSource())
    collector = fixture_collector(source, procfs, clock=clock, **overrides)
    replay = ReplaySource()
    replayer = fixture_collector(replay, procfs, **overrides)
    first = collector.collect()
    replay.load(source.take_readings())
    replayer.collect()
    change(procfs)
    clock.now = 1.0
    second = collector.collect()
    replay.load(source.take_readings())
    assert as_tuples(replayer.collect()) == as_tuples(second)
    return first, second


def test_identities_start_at_zero_exits(procfs_copy):
    first, _ = two_ticks(procfs_copy, lambda procfs: None)
    assert exits_of(first) == {VLLM_IDENTITY_LABELS: (0, 0), LLAMA_IDENTITY_LABELS: (0, 0)}


def test_a_process_gone_with_an_oom_kill_is_counted_as_oom_killed(procfs_copy):
    def killed(procfs):
        add_oom_kills(procfs, 1)
        shutil.rmtree(procfs / "4242")
    _, second = two_ticks(procfs_copy, killed)
    assert exits_of(second) == {VLLM_IDENTITY_LABELS: (1, 1), LLAMA_IDENTITY_LABELS: (0, 0)}


def test_a_clean_exit_is_an_exit_and_no_oom_kill(procfs_copy):
    _, second = two_ticks(procfs_copy, lambda procfs: shutil.rmtree(procfs / "4242"))
    assert exits_of(second)[VLLM_IDENTITY_LABELS] == (1, 0)


def test_an_oom_kill_of_an_unwatched_process_counts_for_no_watched_one(procfs_copy):
    _, second = two_ticks(procfs_copy, lambda procfs: add_oom_kills(procfs, 1))
    assert exits_of(second) == {VLLM_IDENTITY_LABELS: (0, 0), LLAMA_IDENTITY_LABELS: (0, 0)}


def test_two_exits_and_one_kill_blame_neither(procfs_copy):
    def both_gone(procfs):
        add_oom_kills(procfs, 1)
        shutil.rmtree(procfs / "4242")
        shutil.rmtree(procfs / "5151")
    _, second = two_ticks(procfs_copy, both_gone)
    assert exits_of(second) == {VLLM_IDENTITY_LABELS: (1, 0), LLAMA_IDENTITY_LABELS: (1, 0)}


def test_a_zombie_has_exited(procfs_copy):
    def zombie(procfs):
        stat = procfs / "4242/stat"
        stat.write_text(stat.read_text().replace(") S ", ") Z ", 1))
    _, second = two_ticks(procfs_copy, zombie)
    assert exits_of(second)[VLLM_IDENTITY_LABELS] == (1, 0)
    assert {s.label_values[0] for s in per_pid(second)} == {"5151"}


def test_a_gpu_holder_that_frees_its_memory_has_not_exited(procfs_copy):
    """NVML stops listing it, /proc still shows it, same start time: no exit."""
    holders = [{4242: "python3"}, {}]
    clock = FakeClock()
    collector = ProcessCollector(LiveSource(), procfs=str(procfs_copy), names=(), cmdline_patterns=(),
                                 gpu_processes=lambda: holders[0], clock=clock, clock_ticks_per_second=100)
    collector.collect()
    holders.pop(0)
    clock.now = 1.0
    assert exits_of(collector.collect()) == {VLLM_IDENTITY_LABELS: (0, 0)}


def cgroup_host(tmp_path: Path, procfs: Path, cgroups: dict[int, str]) -> Path:
    """A cgroup v2 tree under tmp_path/cg, each pid in its own service cgroup with memory.events."""
    root = tmp_path / "cg"
    (procfs / "self").mkdir(exist_ok=True)
    (procfs / "self/mountinfo").write_text(MOUNTINFO_V2.replace("/sys/fs/cgroup", str(root)))
    for pid, path in cgroups.items():
        (procfs / str(pid) / "cgroup").write_text(f"0::{path}\n")
        (root / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (root / path.lstrip("/") / "memory.events").write_text(
            "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")
    return root


MOUNTINFO_V2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
SERVICES = {4242: "/system.slice/vllm.service", 5151: "/system.slice/llama.service"}


def oom_kill_in(root: Path, cgroup: str) -> None:
    events = root / cgroup.lstrip("/") / "memory.events"
    events.write_text(events.read_text().replace("oom_kill 0", "oom_kill 1"))


def test_the_processs_own_cgroup_decides_where_it_can_be_read(procfs_copy, tmp_path):
    """The host counted one kill and vLLM exited at once, but the kill was in llama-server's cgroup
    (which lost no watched process: a helper of it): vLLM's exit is not an OOM kill. Killed in its
    own cgroup, it is."""
    root = cgroup_host(tmp_path, procfs_copy, SERVICES)

    def elsewhere(procfs):
        add_oom_kills(procfs, 1)
        oom_kill_in(root, SERVICES[5151])
        shutil.rmtree(procfs / "4242")
    _, second = two_ticks(procfs_copy, elsewhere)
    assert exits_of(second)[VLLM_IDENTITY_LABELS] == (1, 0)


def test_killed_in_its_own_cgroup_is_an_oom_kill(procfs_copy, tmp_path):
    root = cgroup_host(tmp_path, procfs_copy, SERVICES)

    def own(procfs):
        add_oom_kills(procfs, 1)
        oom_kill_in(root, SERVICES[4242])
        shutil.rmtree(procfs / "4242")
    _, second = two_ticks(procfs_copy, own)
    assert exits_of(second)[VLLM_IDENTITY_LABELS] == (1, 1)


def test_an_identity_is_forgotten_an_hour_after_its_last_process(procfs_copy):
    from hybridmon.exporters.process import IDENTITY_KEPT_SECONDS
    clock = FakeClock()
    collector = fixture_collector(LiveSource(), procfs_copy, clock=clock)
    collector.collect()
    shutil.rmtree(procfs_copy / "4242")
    clock.now = 1.0
    assert exits_of(collector.collect())[VLLM_IDENTITY_LABELS] == (1, 0)
    clock.now = 1.0 + IDENTITY_KEPT_SECONDS - 1
    assert VLLM_IDENTITY_LABELS in exits_of(collector.collect())
    clock.now = 1.0 + IDENTITY_KEPT_SECONDS + 1
    assert set(exits_of(collector.collect())) == {LLAMA_IDENTITY_LABELS}
