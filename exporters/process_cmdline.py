"""What a process's command line may show: its identity by default, the redacted line on request.

The agent's endpoints are unauthenticated, and command lines carry secrets (API keys, tokens in
URLs, `HF_TOKEN=...` handed to a wrapper). So by default only what an operator needs leaves the
host (identify()): the executable, the inference server family and the model it serves. The whole
line is shown only when `process.export_cmdline` is set, and then through redact().

The flags, as the servers define them: llama.cpp common/arg.cpp (-m/--model, -a/--alias,
-hf/-hfr/--hf-repo, -mu/--model-url; -p is --prompt), TGI's launcher and router (clap: --model-id,
-p/--port; text-generation-server serve MODEL_ID), vLLM (vllm serve MODEL, --model,
--served-model-name), SGLang (--model-path, --served-model-name), Ollama's runner subprocess
(ollama runner --model <blob path>).
"""
from __future__ import annotations

import functools
import os
import re
from collections import deque
from dataclasses import dataclass
from typing import Iterable
from urllib.parse import urlsplit

REDACTED = "<redacted>"
CMDLINE_LIMIT = 200  # characters of the redacted line kept in the label
EXECUTABLE_LIMIT = 64
MODEL_LIMIT = 128

# Names whose value may be a secret, in options (--api-key), env-style assignments (HF_TOKEN=),
# header names (Authorization:) and URL query parameters (?sig=). Broad on purpose: hiding
# --max-num-batched-tokens too costs a detail, a leaked key costs a credential.
_SECRET_NAME = re.compile(r"(?i)(key|token|secret|pass|pwd|auth|credential|cookie|session|signature"
                          r"|private|\bsig\b)")
# Short options whose value is a secret in common tools: -p (sshpass, mysql, openssl, ftp
# clients: a password; llama.cpp's -p is the prompt, user data as well; TGI's -p is the port, a
# detail lost), -k (openssl's key, a passphrase elsewhere). Not -a (llama-server's model alias,
# exported as the model anyway) nor -u (python's unbuffered flag takes no value).
_SECRET_SHORT_OPTIONS = frozenset({"-p", "-k"})
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)=(.*)")
# HTTP auth schemes whose next word is the credential (Authorization: Bearer X).
_AUTH_SCHEME = re.compile(r"(?i:bearer)|Basic|Digest")
# Up to the last @ before the path: a password may hold an @ of its own. After a scheme and any
# run of slashes or backslashes: browsers and curl read `https:/\\user:pw@host` as `https://` (the
# WHATWG URL standard treats \\ as / in special schemes), so a credential written so is one.
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*:[/\\]+)[^/\\?#\s]*@")
# user:password@host without a scheme (git and rsync remotes, pip's index URLs written short): a
# word, or an option's value, that starts with name:anything@. Broad on purpose, as above: an
# image reference `name:tag@sha256:...` loses its name.
_BARE_USERINFO = re.compile(r"(^|[\s=])[^\s/\\:@=?#]+:[^\s/\\?#]*@")
_URL_SECRET_PARAMETER = re.compile(r"([?&])([^=&#\s]+)=([^&#\s]*)")
# Well-known credential shapes, wherever they appear: Hugging Face, OpenAI/Anthropic style,
# GitHub (classic and fine-grained), GitLab, Slack, AWS access key ids, JSON web tokens.
_TOKEN_SHAPES = re.compile(
    r"\bhf_[A-Za-z0-9]{20,}"
    r"|\bsk-[A-Za-z0-9_-]{20,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{16,}"
    r"|\bgithub_pat_[A-Za-z0-9_]{16,}"
    r"|\bglpat-[A-Za-z0-9_-]{16,}"
    r"|\bxox[abposr]-[A-Za-z0-9-]{10,}"
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"
    r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
)

# Server family (the names of exporters/inference_names.SERVERS) by what its command line holds;
# exporters/process.py's DEFAULT_CMDLINE_PATTERNS find the same processes. VLLM:: and sglang:: are the
# titles their worker subprocesses give themselves (setproctitle), which hold the GPU memory.
_SERVER_FAMILIES = (
    ("vllm", re.compile(r"vllm\.entrypoints|(^|[\s/])vllm serve\b|^VLLM::")),
    ("sglang", re.compile(r"sglang\.launch_server|(^|[\s/])sglang serve\b|^sglang::")),
    ("llamacpp", re.compile(r"(^|/)llama-server\b")),
    ("tgi", re.compile(r"(^|[\s/])text-generation-(launcher|router|server)\b")),
    ("ollama", re.compile(r"(^|[\s/])ollama (serve|runner)\b")),
    ("lmcache", re.compile(r"(^|[\s/])lmcache server\b|lmcache\.v1\.multiprocess\.(http_)?server")),
)


@dataclass(frozen=True)
class ModelOptions:
    """Where a server's command line names its model: the name clients ask for first (the servers'
    own metrics label the model with it), then the weights; `subcommand` takes it positionally."""

    served_name: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()
    subcommand: str | None = None


_MODEL_OPTIONS = {
    "vllm": ModelOptions(("--served-model-name",), ("--model",), "serve"),
    "sglang": ModelOptions(("--served-model-name",), ("--model-path", "--model")),
    "llamacpp": ModelOptions(("-a", "--alias"), ("-m", "--model", "-hf", "-hfr", "--hf-repo", "-mu",
                                                 "--model-url")),
    "tgi": ModelOptions(("--served-model-name",), ("--model-id",), "serve"),
    "ollama": ModelOptions((), ("--model",)),
    "lmcache": ModelOptions((), ()),  # one LMCache server serves every model its engines send
    # A GPU holder of no known family: the long options most servers share. Not -m, which is
    # python's module flag.
    "": ModelOptions(("--served-model-name",), ("--model", "--model-path", "--model-id")),
}
_HF_CACHE_DIRECTORY = re.compile(r"models--(.+?)--(.+)")


@dataclass(frozen=True)
class ProcessIdentity:
    """What the command line says the process is; "" where it does not say."""

    executable: str
    server: str
    model: str
    # Bytes of model weights per GPU the line keeps in host memory, read over the bus by every
    # forward pass (weight_offload_bytes()); None where it sets none.
    weights_offload_bytes: float | None = None


def arguments_of(raw: str) -> list[str]:
    """/proc/<pid>/cmdline (arguments ending in NUL) as a list. A process that rewrote its title
    (setproctitle) shows its whole line as one argument padded with NULs: that one is split into
    words."""
    arguments = [argument for argument in raw.split("\0") if argument]
    if len(arguments) == 1:
        return arguments[0].split()
    return arguments


@functools.lru_cache(maxsize=1024)
def identity_of(raw: str) -> ProcessIdentity:
    """identify() of a raw /proc/<pid>/cmdline, remembered: the process collector asks on every
    tick, and a process's command line rarely changes."""
    return identify(arguments_of(raw))


def identify(arguments: list[str]) -> ProcessIdentity:
    """Executable (basename of argv[0]), server family and model, none of them a secret."""
    if not arguments:
        return ProcessIdentity("", "", "")
    first_word = (arguments[0].split() or [""])[0]
    executable = redact_text(os.path.basename(first_word.rstrip("/")))[:EXECUTABLE_LIMIT]
    line = " ".join(arguments)
    server = next((family for family, pattern in _SERVER_FAMILIES if pattern.search(line)), "")
    model = find_model(arguments, _MODEL_OPTIONS[server])
    return ProcessIdentity(executable, server, readable_model(model) if model else "",
                           weight_offload_bytes(arguments) if server in _WEIGHT_OFFLOAD_SERVERS else None)


# vLLM and SGLang take --cpu-offload-gb N: "the space in GiB to offload to CPU, per GPU" (vLLM's
# EngineArgs help; vllm/model_executor/models/utils.py set_cpu_offload_max_bytes(N * 1024**3), the
# same in SGLang's server_args.py and its copy of that helper). The offloaded parameters stay in
# pinned host memory and the GPU reads them through UVA "on the fly in each model forward pass".
_WEIGHT_OFFLOAD_SERVERS = frozenset({"vllm", "sglang"})
_WEIGHT_OFFLOAD_OPTIONS = ("--cpu-offload-gb",)
GIB = 1024 ** 3


def weight_offload_bytes(arguments: list[str]) -> float | None:
    """Bytes of weights per GPU that --cpu-offload-gb keeps in host memory; None when the option
    is absent, zero (its default: no offload) or not a finite non-negative number."""
    value = option_value(arguments, _WEIGHT_OFFLOAD_OPTIONS)
    try:
        gib = float(value) if value is not None else 0.0
    except ValueError:
        return None
    return gib * GIB if 0.0 < gib < float("inf") else None


def find_model(arguments: list[str], options: ModelOptions) -> str | None:
    """The first of: the served name, the weights, the word after the subcommand."""
    for names in (options.served_name, options.weights):
        found = option_value(arguments, names)
        if found:
            return found
    if options.subcommand in arguments:
        after = arguments.index(options.subcommand) + 1
        if after < len(arguments) and not arguments[after].startswith("-"):
            return arguments[after]
    return None


def option_value(arguments: list[str], names: Iterable[str]) -> str | None:
    """The value of the last of these options (argparse: the last one given wins), written
    `--name value` or `--name=value`; of an option taking several (`--served-model-name a b`), the
    first."""
    wanted = frozenset(names)
    found = None
    for index, argument in enumerate(arguments):
        name, equals, value = argument.partition("=")
        if equals and name in wanted:
            found = value
        elif argument in wanted and index + 1 < len(arguments) and not arguments[index + 1].startswith("-"):
            found = arguments[index + 1]
    return found


def readable_model(value: str) -> str:
    """A model reference fit for a label: a URL without user-info, query or fragment (signed URLs
    carry credentials there); a file system path by its last component, so no home directory
    shows (a Hugging Face cache directory by the repository it holds); a repository id as is."""
    if "://" in value:
        reduced = _url_without_secrets(value)
    elif value.startswith(("/", "./", "../", "~")):
        components = [c for c in value.split("/") if c not in ("", ".", "..")]
        cached = next((m for c in components if (m := _HF_CACHE_DIRECTORY.fullmatch(c))), None)
        if cached is not None:
            reduced = f"{cached.group(1)}/{cached.group(2)}"
        else:
            reduced = components[-1] if components else value
    else:
        reduced = value
    return redact_text(reduced)[:MODEL_LIMIT]


def _url_without_secrets(value: str) -> str:
    """scheme://host[:port]/path of a URL. Any process may write anything on its command line
    (issue 30: `--model 'https://x@[::1'` made urlsplit raise and blinded the collector to every
    process): where the URL does not parse, the text is cut at its query or fragment, and
    redact_text() takes its user-info."""
    try:
        parts = urlsplit(value)
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
    except ValueError:   # an unclosed IPv6 bracket, a port that is no number or out of range
        return re.split(r"[?#]", value, maxsplit=1)[0]
    return f"{parts.scheme}://{host}{parts.path}"


def cmdline_label(raw: str) -> str:
    """/proc/<pid>/cmdline redacted (redact()), then cut to 200 characters."""
    return " ".join(redact(raw.split("\0")))[:CMDLINE_LIMIT]


def redact(arguments: Iterable[str]) -> list[str]:
    """The words of a command line with every secret replaced by <redacted>.

    Hidden: the value of an option whose name looks secret (`--api-key X`, `--api-key=X`, also
    single-dash `-token X`) and of the short options -p and -k; the value of an env-style
    assignment whose name looks secret (`HF_TOKEN=...`, `AWS_SECRET_ACCESS_KEY=...`); the word
    after an auth scheme (`Bearer X`) or a secret header name (`X-Api-Key: X`); URL user-info and
    secret query parameters; well-known token shapes (hf_, sk-, ghp_, AKIA..., JWTs) anywhere.

    An option's value is hidden whole even when it holds spaces; any other argument holding spaces is split
    into words first, since a process that rewrote its title shows its line as one argument. The
    word after a secret option is its value unless it starts with "--" (a value may start with
    one dash: a password can).
    """
    words: list[str] = []
    pending = deque(arguments)
    hide_next = False
    while pending:
        argument = pending.popleft()
        if hide_next and not argument.lstrip().startswith("--"):
            if _AUTH_SCHEME.fullmatch(argument.strip()):
                words.append(argument.strip())  # "X-Api-Key: Bearer X": the credential comes next
                continue
            hide_next = False
            if argument.strip():
                words.append(REDACTED)
            continue
        hide_next = False
        name, equals, _ = argument.partition("=")
        if equals and (_is_secret_option(name) or _is_secret_assignment(argument)):
            words.append(f"{name}={REDACTED}")
            continue
        parts = argument.split()
        if len(parts) > 1:
            pending.extendleft(reversed(parts))
        elif parts:
            word = parts[0]
            words.append(redact_text(word))
            hide_next = (_is_secret_option(word) or _AUTH_SCHEME.fullmatch(word) is not None
                         or (word.endswith(":") and _SECRET_NAME.search(word) is not None))
    return words


def redact_text(text: str) -> str:
    """URL user-info, secret URL query parameters and token shapes replaced, wherever they are."""
    text = _URL_USERINFO.sub(rf"\1{REDACTED}@", text)
    text = _BARE_USERINFO.sub(rf"\1{REDACTED}@", text)
    text = _URL_SECRET_PARAMETER.sub(
        lambda m: f"{m[1]}{m[2]}={REDACTED}" if _SECRET_NAME.search(m[2]) else m[0], text)
    return _TOKEN_SHAPES.sub(REDACTED, text)


def _is_secret_option(word: str) -> bool:
    if not word.startswith("-") or any(c.isspace() for c in word):
        return False
    return word in _SECRET_SHORT_OPTIONS or _SECRET_NAME.search(word) is not None


def _is_secret_assignment(argument: str) -> bool:
    # An argument with spaces is a shell line (sh -c "HF_TOKEN=x vllm serve ..."): split first.
    if any(c.isspace() for c in argument):
        return False
    match = _ASSIGNMENT.fullmatch(argument)
    return match is not None and _SECRET_NAME.search(match.group(1)) is not None
