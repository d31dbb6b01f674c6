"""What inference servers publish, read into one small model per server and model.

vLLM, SGLang, llama.cpp, TGI and LMCache publish the Prometheus text format on /metrics, each with
its own names, and the names change between versions; Ollama publishes no metrics but answers
GET /api/ps with the models it holds. Tables map each server's names (newest first) onto one
`ServerStats`, so a detector reads "generated tokens" or "KV cache usage" without knowing which
server it is looking at. The tables are in inference_names.py, and per server in
docs/inference-servers.md.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families

from hybridmon.exporters.base import ParseError
from hybridmon.exporters.prometheus_text import Bounds, lines_of, plain_sample_index
from hybridmon.exporters.inference_names import ALL_PREFIXES, EXPECTED, MODELLESS_JOINED, PREFIXES, RULES, Rule
from hybridmon.exporters import inference_llamacpp
from hybridmon.exporters.inference_stats import Histogram, SampleIndex, ServerStats

# LMCache labels its series with the model path (model_name) and, since vLLM passes it, the name
# vLLM serves it under (served_model_name, "" when not given: lmcache/observability.py:1906): the
# served name is the one vLLM's own series carry, so it is taken first where set.
MODEL_LABELS = ("served_model_name", "model_name", "model")
PERCENTILES = {"p50": 0.5, "p95": 0.95}
_LEADING_NAME = re.compile(r"\s*([^\s{]*)")

# Samples of one name kept from a body (issue 30: a peer's 36,000 models in a 7.9 MB body held
# ~190 MB while it was indexed). A real server stays far under it: vLLM's largest family, a
# histogram's buckets, is ~30 buckets x its engines x its models, 7,680 at 16 models x 16 engines.
MAX_SAMPLES_PER_NAME = 8192


def parse_prometheus(text: str, max_per_name: int | None = MAX_SAMPLES_PER_NAME,
                     max_models: int | None = None) -> SampleIndex:
    """Prometheus text format -> {sample name: [(labels, value)]}; NaN and infinite values left out;
    at most `max_per_name` samples of a name, and the samples of at most `max_models` models (their
    MODEL_LABELS), the first ones in the body.

    Indexed by sample name rather than family so that a body without # TYPE lines reads the same.
    """
    def bounds() -> Bounds:
        return Bounds(max_per_name, MODEL_LABELS, max_models)
    # most bodies, in C; None sends the rest to prometheus_client
    plain = plain_sample_index(text, bounds())
    if plain is not None:
        return plain
    return parse_with_prometheus_client(text, bounds())


def parse_with_prometheus_client(text: str, bounds: Bounds | None = None) -> SampleIndex:
    """parse_prometheus by prometheus_client's parser alone: every body the fast path reads must
    read the same here (tests/exporters/test_prometheus_text.py)."""
    index: SampleIndex = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value = float(sample.value)
                if math.isfinite(value):
                    labels = dict(sample.labels)
                    if bounds is None or bounds.admits(index.get(sample.name), labels):
                        index.setdefault(sample.name, []).append((labels, value))
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError) as error:
        raise ParseError(f"not the Prometheus text format: {str(error)[:120]}") from None
    return index


def keep_known_families(text: str) -> str:
    """Only the lines of the servers' own families (vLLM's /metrics also carries Python, process
    and HTTP families), so that a recorded trace keeps what is read; the text unchanged when it
    holds no known family at all, so that an HTML page or another exporter is told apart later."""
    # A first pass, holding no line: a body of known families only (a server's own exporter, or a
    # peer's 7.9 MB of them) is returned as it is, not copied line by line (issue 30).
    every_line_known, some_line_known = True, False
    for line in lines_of(text):
        if not line.strip():
            continue   # a blank line is no family's
        if _line_metric(line).startswith(ALL_PREFIXES):
            some_line_known = True
        else:
            every_line_known = False
            if some_line_known:
                break
    if every_line_known or not some_line_known:
        return text
    kept = [line for line in lines_of(text) if _line_metric(line).startswith(ALL_PREFIXES)]
    return "\n".join(kept) + "\n"


def _line_metric(line: str) -> str:
    if line.startswith(("# HELP ", "# TYPE ", "# UNIT ")):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 else ""
    return _LEADING_NAME.match(line).group(1)


def detect_servers(index: SampleIndex) -> list[str]:
    """The servers whose prefix some sample carries, in PREFIXES order."""
    return [server for server, prefixes in PREFIXES.items() if any(name.startswith(prefixes) for name in index)]


def normalise(server: str, index: SampleIndex, notes: list[str] | None = None) -> list[ServerStats]:
    """One ServerStats per model the server reports (model "" where it names none). Why model-less
    series could not be given a model is appended to `notes`, for the caller to log."""
    by_model: dict[str, dict[str, object]] = {}
    for rule in RULES[server]:
        for model, value in _read(rule, index).items():
            by_model.setdefault(model, {}).setdefault(rule.field, value)
    if server in MODELLESS_JOINED:
        _join_modelless(server, by_model, notes if notes is not None else [])
    stats = [ServerStats(server, model, **values) for model, values in sorted(by_model.items())]
    return inference_llamacpp.refine(server, index, stats)  # llama.cpp's tokens during a request


def _join_modelless(server: str, by_model: dict[str, dict[str, object]], notes: list[str]) -> None:
    """The fields read from series without a model label filed under the endpoint's model, when it
    serves exactly one (SGLang's HiCache families, vLLM's cache_config_info: one process serves one
    model). With several, which model they belong to is not in the body: they stay under ""."""
    if "" not in by_model:
        return
    named = sorted(model for model in by_model if model)
    if len(named) == 1:
        for field_name, value in by_model.pop("").items():
            by_model[named[0]].setdefault(field_name, value)
    elif named:
        notes.append(f"{server}: {', '.join(sorted(by_model['']))} come from series without a model "
                     f"label and the endpoint serves {len(named)} models ({', '.join(named)}): which "
                     "one they belong to is not published, so they are kept under model \"\"")


def _model(labels: dict[str, str]) -> str:
    return next((labels[name] for name in MODEL_LABELS if labels.get(name)), "")


def _matching(index: SampleIndex, name: str, rule: Rule) -> list[tuple[dict[str, str], float]]:
    return [(labels, value) for labels, value in index.get(name, ())
            if all(labels.get(key) == wanted for key, wanted in rule.labels)
            and not any(labels.get(key) == unwanted for key, unwanted in rule.labels_not)
            and not (rule.total_under_empty and labels.get(rule.total_under_empty, ""))]


def _one_per_rank_group(samples: list[tuple[dict[str, str], float]], rule: Rule) -> list[tuple[dict[str, str], float]]:
    """The largest of the series that differ only in rank labels (every rank reports the same
    logical count there), so that TP ranks are not added up."""
    if not rule.same_on_every_rank:
        return samples
    groups: dict[tuple, tuple[dict[str, str], float]] = {}
    for labels, value in samples:
        key = tuple(sorted((k, v) for k, v in labels.items() if k not in rule.same_on_every_rank))
        if key not in groups or value > groups[key][1]:
            groups[key] = (labels, value)
    return list(groups.values())


def _combined(index: SampleIndex, name: str, rule: Rule) -> dict[str, float]:
    grouped: dict[str, list[float]] = {}
    for labels, value in _one_per_rank_group(_matching(index, name, rule), rule):
        grouped.setdefault(_model(labels), []).append(value)
    combine = {"sum": sum, "max": max, "mean": lambda values: sum(values) / len(values)}[rule.combine]
    return {model: combine(values) for model, values in grouped.items()}


def _from_label(index: SampleIndex, rule: Rule) -> dict[str, float]:
    """A number carried in a label of an info-style series (vLLM's kv_offload_config_info), summed
    over the series of one model (one per engine). A label that is empty or "None" is absent."""
    found: dict[str, float] = {}
    for labels, _ in _matching(index, rule.sample, rule):
        try:
            number = float(labels.get(rule.label, "")) * rule.scale
        except ValueError:
            continue
        if math.isfinite(number) and number >= 0:
            found[_model(labels)] = found.get(_model(labels), 0.0) + number
    return found


def _by_label(index: SampleIndex, rule: Rule) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for value_of_label in sorted({labels.get(rule.label, "") for labels, _ in _matching(index, rule.sample, rule)}):
        narrowed = replace(rule, how="value", labels=(*rule.labels, (rule.label, value_of_label)))
        for model, value in _combined(index, rule.sample, narrowed).items():
            found.setdefault(model, {})[value_of_label] = value
    return found


def _read(rule: Rule, index: SampleIndex) -> dict[str, object]:
    if rule.how == "value":
        return _combined(index, rule.sample, rule)
    if rule.how == "label":
        return _from_label(index, rule)
    if rule.how == "by_label":
        return _by_label(index, rule)
    sums = _combined(index, rule.sample + "_sum" if rule.how != "sum_count" else rule.sample, rule)
    if rule.how == "histogram_sum":
        return sums
    counts = _combined(index, rule.count_sample or rule.sample + "_count", rule)
    if rule.how == "sum_count":
        return {model: Histogram((), sums[model], counts[model]) for model in sums if model in counts}
    buckets: dict[str, dict[float, float]] = {}
    for labels, value in _matching(index, rule.sample + "_bucket", rule):
        try:
            bound = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if not math.isnan(bound):
            model_buckets = buckets.setdefault(_model(labels), {})
            model_buckets[bound] = model_buckets.get(bound, 0.0) + value
    found = {}
    for model, by_bound in buckets.items():
        if math.inf in by_bound and model in sums and model in counts:
            found[model] = Histogram(tuple(sorted(by_bound.items())), sums[model], counts[model])
    return found


def _join_lmcache_to_vllm(stats: list[ServerStats]) -> list[ServerStats]:
    """LMCache inside vLLM labels its series with the model path (LMCache's model_name), vLLM with
    the served name, so under --served-model-name the two differ. One vLLM process serves one
    model, so LMCache's series in the same body are that model's: they take vLLM's name."""
    vllm_models = {s.model for s in stats if s.server == "vllm"}
    if len(vllm_models) != 1 or sum(s.server == "lmcache" for s in stats) != 1:
        return stats  # not one model each: which belongs to which is not known
    (served,) = vllm_models
    for entry in stats:
        if entry.server == "lmcache":
            entry.model = served
    return stats


def parse_ollama_ps(text: str) -> list[ServerStats]:
    """Ollama's GET /api/ps: {"models": [{"name", "size", "size_vram", ...}]}. The bytes of a model
    that are not in GPU memory (size - size_vram) sit in host memory and run on the CPU."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ParseError(f"not JSON: {str(error)[:80]}") from None
    if not isinstance(document, dict) or not isinstance(document.get("models", False), (list, type(None))):
        raise ParseError("not an Ollama /api/ps answer: no 'models' list")
    stats = []
    for entry in document.get("models") or []:
        if not isinstance(entry, dict):
            raise ParseError("an entry of 'models' is not an object")
        name = entry.get("name") or entry.get("model")
        size, in_vram = _byte_count(entry.get("size")), _byte_count(entry.get("size_vram"))
        if not isinstance(name, str) or size is None:
            raise ParseError("an entry of 'models' lacks a name or a size")
        host = size - in_vram if in_vram is not None and in_vram <= size else None
        stats.append(ServerStats("ollama", name, model_size_bytes=size, model_host_memory_bytes=host))
    return stats


def _byte_count(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def recent_quantile(previous: Histogram | None, current: Histogram, quantile: float) -> float | None:
    """The quantile of the observations made between two scrapes, as Prometheus's
    histogram_quantile computes it: linear within the bucket, the highest finite bound when it
    falls in +Inf. None without a previous scrape, buckets or new observations. A count that went
    down (the server restarted) or changed bounds counts everything since the restart."""
    if previous is None or not current.buckets:
        return None
    bounds = [bound for bound, _ in current.buckets]
    counts = [count for _, count in current.buckets]
    before = [count for _, count in previous.buckets]
    if [bound for bound, _ in previous.buckets] == bounds and all(
            now >= then for now, then in zip(counts, before)):
        counts = [now - then for now, then in zip(counts, before)]
    for i in range(1, len(counts)):  # cumulative counts never fall; repair a torn read
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return None
    rank = quantile * total
    position = next(i for i, count in enumerate(counts) if count >= rank)
    if math.isinf(bounds[position]):
        return bounds[position - 1] if position > 0 else None
    lower = bounds[position - 1] if position > 0 else min(0.0, bounds[0])
    below = counts[position - 1] if position > 0 else 0.0
    return lower + (bounds[position] - lower) * (rank - below) / (counts[position] - below)


@dataclass
class Interpretation:
    """What one scrape's answer says: the stats read from it, or why it could not be read."""

    stats: list[ServerStats] = field(default_factory=list)
    error: str | None = None
    detail: str = ""
    notes: list[str] = field(default_factory=list)  # what was read but could not be placed, and why


def interpret(answer: dict, server: str | None, max_models: int | None = None) -> Interpretation:
    """The stats in one answer of inference_scrape.fetch, or the scrape error it shows.

    `server`: the kind configured for the endpoint, None to detect it from the metric prefixes.
    `max_models`: the models read of a body at most (parse_prometheus), the first ones.
    A body that holds no family of the expected server, or whose server lacks a family every
    version of it publishes, is an error (unknown_server, missing_families): the names changed.
    """
    if answer.get("error"):
        return Interpretation(error=answer["error"], detail=answer.get("detail", ""))
    if answer.get("status") != 200:
        return Interpretation(error="http_status", detail=f"HTTP {answer.get('status')}")
    body = answer.get("body") or ""
    if server == "ollama" or (server is None and answer.get("url", "").endswith("/api/ps")):
        try:
            return Interpretation(parse_ollama_ps(body))
        except ParseError as error:
            return Interpretation(error="not_json", detail=str(error))
    if "html" in (answer.get("content_type") or "").lower():
        return Interpretation(error="not_prometheus", detail=f"the body is {answer['content_type']}")
    try:
        index = parse_prometheus(body, max_models=max_models)
    except ParseError as error:
        return Interpretation(error="not_prometheus", detail=str(error))
    found = detect_servers(index)
    if not found or (server is not None and server not in found):
        wanted = "*, ".join(PREFIXES[server] if server else ALL_PREFIXES)
        return Interpretation(error="unknown_server", detail=f"no family named {wanted}*")
    primary = server or found[0]
    notes: list[str] = []
    stats = _join_lmcache_to_vllm([stats for kind in found for stats in normalise(kind, index, notes)])
    known = set().union(*(s.known_fields() for s in stats if s.server == primary))
    missing = [name for name in EXPECTED[primary] if name not in known]
    if missing or not known:
        return Interpretation(stats, "missing_families",
                              f"{primary}: nothing read for {', '.join(missing) or 'any field'}", notes)
    return Interpretation(stats, notes=notes)
