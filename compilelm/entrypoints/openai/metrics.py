"""Prometheus metrics under vLLM's names, on a registry per server: each series as
`compilelm:<name>` and again as `vllm:<name>` (the same values, plus vLLM's `engine="0"` label), so
dashboards and alerts written for vLLM work unchanged; `vllm:time_per_output_token_seconds` and
`vllm:gpu_cache_usage_perc`, the names older vLLM dashboards query, are there too (vLLM still
exports them, deprecated). Metrics vLLM has no name for (`compilelm:request_rejections`) stay
under `compilelm:` only.

Gauges and engine-wide counters (running/waiting, KV-cache usage, prefix cache, preemptions,
token totals) are read from the engine's stats snapshot at scrape time, so they can never drift
from the engine. Per-request histograms (TTFT, inter-token latency, end-to-end, queue time) are
observed by the engine thread as tokens arrive; HTTP-side rejections are counted by the server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineStatsCollector:
    """Emits the engine's gauges and cumulative counters from `stats_fn()` at scrape time."""

    def __init__(self, stats_fn, model_name: str):
        self.stats_fn = stats_fn
        self.labels = {"model_name": model_name}

    def collect(self):
        stats = self.stats_fn() or {}
        for name, key, doc in (
            ("num_requests_running", "num_running", "Requests in the running batch."),
            ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
            ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0-1)."),
        ):
            g = GaugeMetricFamily(f"compilelm:{name}", doc, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), float(stats.get(key, 0)))
            yield g
        for name, key, doc in (
            ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            ("num_preemptions", "num_preemptions", "Requests preempted (KV cache full)."),
            ("prompt_tokens", "prompt_tokens_total", "Prompt tokens processed."),
            ("generation_tokens", "generation_tokens_total", "Tokens generated."),
        ):
            c = CounterMetricFamily(f"compilelm:{name}", doc, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), float(stats.get(key, 0)))
            yield c


# compilelm family -> the vLLM families it is also exported as
VLLM_NAMES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
}


class _WithVllmNames:
    """Collects `own` (the compilelm: registry) and yields every family as it is, then, for the
    families in VLLM_NAMES, a copy under each vLLM name with the label `engine="0"` added."""

    def __init__(self, own: CollectorRegistry):
        self.own = own

    def collect(self):
        for family in self.own.collect():
            yield family
            for vllm_name in VLLM_NAMES.get(family.name.removeprefix("compilelm:"), ()):
                copy = Metric(f"vllm:{vllm_name}", family.documentation, family.type, family.unit)
                for sample in family.samples:
                    suffix = sample.name[len(family.name):]
                    copy.samples.append(Sample(copy.name + suffix, {**sample.labels, "engine": "0"},
                                               sample.value, sample.timestamp, sample.exemplar))
                yield copy


@dataclass
class _Timing:
    """One request's timestamps (time.monotonic), kept from the engine thread."""

    arrival: float
    num_prompt_tokens: int
    num_tokens: list[int]  # per choice, tokens seen so far
    scheduled: bool = False
    first_token: float | None = None
    last_token: float | None = None


class ServerMetrics:
    """All metrics of one server. The `request_*` / `step_done` hooks are called by the
    AsyncLLMEngine's thread; `count_rejection` by the HTTP side."""

    def __init__(self, model_name: str, stats_fn):
        own = CollectorRegistry(auto_describe=True)  # the compilelm: families
        own.register(_EngineStatsCollector(stats_fn, model_name))
        self.registry = CollectorRegistry(auto_describe=False)  # what /metrics renders
        self.registry.register(_WithVllmNames(own))
        labels = ["model_name"]
        self.model_name = model_name

        def hist(name, doc, buckets):
            return Histogram(f"compilelm:{name}", doc, labels, buckets=buckets,
                             registry=own).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to finish.",
                        _LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time waiting before first scheduled.",
                               _LATENCY_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.generation_tokens = hist("request_generation_tokens", "Generated tokens per request.",
                                      _TOKEN_BUCKETS)
        self._success = Counter("compilelm:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=own)
        self._rejected = Counter("compilelm:request_rejections", "Requests refused before the engine.",
                                 labels + ["reason"], registry=own)
        self._timings: dict[str, _Timing] = {}

    # -- hooks (engine thread) -----------------------------------------------------------------

    def request_added(self, request_id: str, num_prompt_tokens: int, n: int, arrival: float):
        self._timings[request_id] = _Timing(arrival, num_prompt_tokens, [0] * n)

    def step_done(self, outputs, now: float, started) -> None:
        """After a step: queue time of requests scheduled for the first time (`started(id)`),
        TTFT / inter-token latency of the requests that got tokens."""
        for rid, t in self._timings.items():
            if not t.scheduled and started(rid):
                t.scheduled = True
                self.queue_time.observe(now - t.arrival)
        for out in outputs:
            t = self._timings.get(out.request_id)
            if t is None:
                continue
            new = 0
            for c in out.outputs:
                if c.index < len(t.num_tokens):
                    new += len(c.token_ids) - t.num_tokens[c.index]
                    t.num_tokens[c.index] = len(c.token_ids)
            if new <= 0:
                continue
            if t.first_token is None:
                t.first_token = now
                self.ttft.observe(now - t.arrival)
            else:
                self.itl.observe(now - t.last_token)
            t.last_token = now

    def request_finished(self, request_id: str, reason: str) -> None:
        """reason: stop | length | abort | error | mixed (n > 1 choices ended differently)."""
        t = self._timings.pop(request_id, None)
        if t is None:
            return
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(time.monotonic() - t.arrival)
        self.prompt_tokens.observe(t.num_prompt_tokens)
        self.generation_tokens.observe(sum(t.num_tokens))

    def count_rejection(self, reason: str) -> None:
        """reason: queue_full | draining | loading | engine_dead."""
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
