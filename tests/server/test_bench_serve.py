"""`compilelm bench serve` against the suite's live server: every request answered, the server's
usage adding up to the random dataset recomputed here, the concurrency cap held, vLLM's report."""

import json
import subprocess
import sys

from compilelm.entrypoints.bench.dataset import random_requests
from tests.server.utils import API_KEY

VOCAB = 49152  # the default model's tokenizer


def _bench(server, tmp_path, *args):
    env = {**__import__("os").environ, "OPENAI_API_KEY": API_KEY}
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "compilelm.entrypoints.cli", "bench", "serve", "--base-url", server.url,
                        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
                        "--disable-tqdm", *args], capture_output=True, text=True, timeout=600, env=env)
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_bench_serve_completions(server, tmp_path):
    r, res = _bench(server, tmp_path, "--num-prompts", "10", "--random-input-len", "30", "--random-output-len",
                    "6", "--random-range-ratio", "0.3", "--ignore-eos", "--max-concurrency", "3", "--seed", "2",
                    "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90")
    assert r.returncode == 0, r.stdout + r.stderr
    want = random_requests(10, 30, 6, VOCAB, 0.3, 0, seed=2)
    assert res["completed"] == 10 and res["failed"] == 0
    assert res["total_input_tokens"] == sum(len(q.prompt_token_ids) for q in want)  # the server's usage
    assert res["total_output_tokens"] == sum(q.output_len for q in want)
    assert res["peak_concurrency"] == 3  # all sent at once (rate inf), three let through at a time
    assert 0 < res["median_ttft_ms"] <= res["median_e2el_ms"] and res["mean_itl_ms"] > 0 and res["p90_tpot_ms"] > 0
    assert res["p50_ttft_ms"] == res["median_ttft_ms"]
    assert "Successful requests:                     10" in r.stdout and "P90 E2EL (ms):" in r.stdout


def test_bench_serve_chat_at_a_request_rate(server, tmp_path):
    r, res = _bench(server, tmp_path, "--backend", "openai-chat", "--num-prompts", "4", "--random-input-len", "12",
                    "--random-output-len", "4", "--ignore-eos", "--request-rate", "8", "--burstiness", "0.5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert res["completed"] == 4 and res["total_output_tokens"] == 16
    assert res["total_input_tokens"] > 4 * 12  # the decoded ids re-tokenized inside the chat template
    assert res["request_rate"] == 8.0 and "Request rate configured (RPS):           8.00" in r.stdout


def test_bench_serve_unknown_model_fails_before_the_run(server, tmp_path):
    r, res = _bench(server, tmp_path, "--model", "no-such-model", "--tokenizer", "default", "--num-prompts", "2")
    assert r.returncode == 2 and "first test request failed" in r.stderr and "404" in r.stderr, r.stderr
    assert res is None
