"""The periodic stats line, in vLLM's words (log parsers written for vLLM read it):

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.0 tokens/s,
    Running: 3 reqs, Waiting: 0 reqs, GPU KV cache usage: 4.2%, Prefix cache hit rate: 37.5%

every `VLLM_LOG_STATS_INTERVAL` seconds (vLLM's variable, default 10), from the engine's stats
snapshot: throughputs over the interval, the queue and cache now, the prefix-cache hit rate over
the interval's lookups (the last one seen when there were none). As in vLLM, an idle server
(no tokens in this interval or the one before) logs it at DEBUG, not INFO; `--disable-log-stats`
turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger("compilelm")

_DEFAULT_INTERVAL_S = 10.0


def log_interval() -> float:
    raw = os.environ.get("VLLM_LOG_STATS_INTERVAL")
    try:
        value = float(raw) if raw else _DEFAULT_INTERVAL_S
    except ValueError:
        logger.warning("VLLM_LOG_STATS_INTERVAL=%r is not a number; using %.0f s", raw, _DEFAULT_INTERVAL_S)
        return _DEFAULT_INTERVAL_S
    return value if value > 0 else _DEFAULT_INTERVAL_S


class StatsLogger:
    def __init__(self, stats_fn: Callable[[], dict], interval: float | None = None):
        self.stats_fn = stats_fn
        self.interval = interval or log_interval()
        self._last = dict(stats_fn() or {})
        self._last_time = time.monotonic()
        self._was_busy = False
        self._hit_rate = 0.0

    def log(self) -> None:
        now, stats = time.monotonic(), dict(self.stats_fn() or {})
        elapsed = max(now - self._last_time, 1e-9)

        def delta(key: str) -> float:
            return stats.get(key, 0) - self._last.get(key, 0)

        prompt, generation = delta("prompt_tokens_total") / elapsed, delta("generation_tokens_total") / elapsed
        queries = delta("prefix_cache_queries")
        if queries > 0:
            self._hit_rate = delta("prefix_cache_hits") / queries
        busy = bool(prompt or generation)
        log = logger.info if busy or self._was_busy else logger.debug
        self._last, self._last_time, self._was_busy = stats, now, busy
        log("Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt, generation, stats.get("num_running", 0), stats.get("num_waiting", 0),
            100 * stats.get("kv_cache_usage", 0.0), 100 * self._hit_rate)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.log()
