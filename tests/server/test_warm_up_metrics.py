"""A compiled engine runs a warm-up request before it is ready; /metrics counts only what the
server served: zero before the first request, then exactly that request's tokens."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.utils import dummy_server

pytestmark = pytest.mark.slow

COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
            "prefix_cache_hits_total", "num_preemptions_total")


def _counters(c: httpx.Client) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            name = s.name.removeprefix("compilelm:")
            if name in COUNTERS:
                out[name] = s.value
    return out


def test_warm_up_is_not_counted():
    srv = dummy_server(max_num_seqs=4, max_queue_len=None, optimization_level=1)
    try:
        engine = srv.state.async_engine.engine
        assert engine.stats()["prompt_tokens_total"] > 0  # the warm-up ran
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert _counters(c) == dict.fromkeys(COUNTERS, 0.0)
            r = c.post("/v1/completions", json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 3,
                                                "ignore_eos": True}).json()
            after = _counters(c)
        assert after["prompt_tokens_total"] == r["usage"]["prompt_tokens"] == 5
        assert after["generation_tokens_total"] == r["usage"]["completion_tokens"] == 3
        assert after["prefix_cache_queries_total"] == 5
    finally:
        srv.close()
