"""What a vLLM operator watches, unchanged: /metrics under vLLM's `vllm:` names (parsed with
prometheus_client's parser: the same values as the `compilelm:` series after a known workload),
the periodic stats line, `--enable-log-requests`, the access log and its switch, CORS flags."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hf_fixtures import tiny_llama
from tests.server.utils import RemoteServer

SMALL = ["--enforce-eager", "--max-model-len", "128", "--num-kv-blocks", "40", "--block-size", "4"]
PROMPT = list(range(3, 23))  # 20 tokens: 5 full blocks, a prefix-cache hit the second time


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("obs") / "m", vocab_size=64)


@pytest.fixture(scope="module")
def srv(model):
    os.environ["VLLM_LOG_STATS_INTERVAL"] = "0.5"
    try:
        server = RemoteServer([str(model), *SMALL, "--served-model-name", "tiny", "--enable-log-requests",
                               "--max-log-len", "4", "--allowed-origins", '["https://ok.example"]'])
    finally:
        del os.environ["VLLM_LOG_STATS_INTERVAL"]
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for max_tokens in (3, 4, 5):  # a known workload: 3 requests, 60 prompt and 12 output tokens
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True})
            r.raise_for_status()
    time.sleep(1.2)  # a stats interval or two
    yield server
    server.close()


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_vllm_series_equal_the_compilelm_series(srv):
    samples = _samples(httpx.get(f"{srv.url}/metrics").text)
    vllm = {k: v for k, v in samples.items() if k[0].startswith("vllm:")}
    renamed = {"vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
               "vllm:time_per_output_token_seconds": "vllm:inter_token_latency_seconds"}
    checked = 0
    for (name, labels), value in vllm.items():
        assert dict(labels)["engine"] == "0" and dict(labels)["model_name"] == "tiny"
        for old, new in renamed.items():
            name = name.replace(old, new)
        twin = (name.replace("vllm:", "compilelm:", 1), labels - {("engine", "0")})
        if twin[0].endswith("_created"):
            continue
        assert samples[twin] == value, (name, dict(labels))
        checked += 1
    assert checked > 50

    def get(name, **labels):
        return samples[(name, frozenset({"model_name": "tiny", "engine": "0", **labels}.items()))]

    assert get("vllm:prompt_tokens_total") == 60 and get("vllm:generation_tokens_total") == 12
    assert get("vllm:request_success_total", finished_reason="length") == 3
    assert get("vllm:time_to_first_token_seconds_count") == 3
    assert get("vllm:inter_token_latency_seconds_count") == 2 + 3 + 4
    assert get("vllm:e2e_request_latency_seconds_count") == 3
    assert get("vllm:request_prompt_tokens_sum") == 60
    assert get("vllm:prefix_cache_hits_total") > 0
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert get(gauge) == 0


def test_stats_line_request_log_and_access_log(srv):
    log = srv.log()
    busy = [line for line in log.splitlines() if "Engine 000: Avg prompt throughput:" in line]
    assert busy, log
    assert any("Avg generation throughput: 0.0" not in line for line in busy)
    assert "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage:" in busy[-1]
    assert "Prefix cache hit rate:" in busy[-1]
    received = [line for line in log.splitlines() if "Received request cmpl-" in line]
    assert len(received) == 3 and "prompt_token_ids: [3, 4, 5, 6]." in received[0]
    assert "max_tokens=3" in received[0]
    assert '"POST /v1/completions HTTP/1.1" 200' in log


def test_cors_follows_the_flags(srv):
    ok = httpx.options(f"{srv.url}/v1/completions", headers={
        "Origin": "https://ok.example", "Access-Control-Request-Method": "POST"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    other = httpx.options(f"{srv.url}/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def test_logs_can_be_switched_off(model):
    srv = RemoteServer([str(model), *SMALL, "--disable-uvicorn-access-log", "--disable-log-stats",
                        "--disable-log-requests"])
    try:
        httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).raise_for_status()
        time.sleep(0.3)
        log = srv.log()
    finally:
        srv.close()
    assert "POST /v1/completions" not in log and "Received request" not in log
    assert "Engine 000:" not in log
    assert log.count("--disable-log-requests: requests are not logged by default") == 1


def test_stats_logger_rates_and_idle_level(caplog, monkeypatch):
    import logging
    import types

    from compilelm.entrypoints.openai import stats_logger
    from compilelm.entrypoints.openai.stats_logger import StatsLogger

    clock = [1000.0]  # the logger's monotonic clock, advanced by hand: rates over exactly 2 s
    monkeypatch.setattr(stats_logger, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    stats = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "prefix_cache_queries": 0,
             "prefix_cache_hits": 0, "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
    sl = StatsLogger(lambda: stats, interval=1.0)
    clock[0] += 2.0
    stats.update(prompt_tokens_total=100, generation_tokens_total=20, prefix_cache_queries=100,
                 prefix_cache_hits=25, num_running=2, num_waiting=1, kv_cache_usage=0.5)
    with caplog.at_level(logging.DEBUG, logger="compilelm"):
        sl.log()
        sl.log()  # the interval after a busy one is still INFO
        sl.log()  # idle twice: DEBUG
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == ("INFO", "Engine 000: Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: "
                                "10.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 50.0%, "
                                "Prefix cache hit rate: 25.0%")
    assert [level for level, _ in lines] == ["INFO", "INFO", "DEBUG"]
