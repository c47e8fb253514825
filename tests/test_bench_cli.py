"""`compilelm bench latency | throughput` run as a user would (a subprocess), their counts checked
against the random dataset recomputed here; the dataset's own rules; flags named on bad input.
`bench serve` against a live server: tests/server/test_bench_serve.py."""

import json
import subprocess
import sys

import pytest

from compilelm.entrypoints.bench.dataset import random_requests, sharegpt_requests

TINY = ["--model", "dummy:smollm2-135m", "--enforce-eager", "--max-model-len", "256", "--num-kv-blocks", "64"]
VOCAB = 49152  # SmolLM2-135M's, the dummy preset's


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "compilelm.entrypoints.cli", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_random_dataset_lengths_prefix_and_seed():
    reqs = random_requests(200, 40, 10, vocab_size=500, range_ratio=0.5, prefix_len=7, seed=3)
    assert all(20 + 7 <= len(r.prompt_token_ids) <= 60 + 7 and 5 <= r.output_len <= 15 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:7]) for r in reqs}) == 1  # one shared prefix
    assert len({tuple(r.prompt_token_ids[7:]) for r in reqs}) == 200
    assert all(0 <= t < 500 for r in reqs for t in r.prompt_token_ids)
    assert {len(r.prompt_token_ids) for r in reqs} >= {27, 67}  # both ends of the range are drawn
    assert random_requests(200, 40, 10, 500, 0.5, 7, seed=3) == reqs
    assert random_requests(200, 40, 10, 500, 0.5, 7, seed=4) != reqs
    fixed = random_requests(5, 12, 3, 500)
    assert [len(r.prompt_token_ids) for r in fixed] == [12] * 5 and [r.output_len for r in fixed] == [3] * 5


def test_throughput_counts_every_drawn_token(tmp_path):
    out = tmp_path / "t.json"
    r = _cli("throughput", *TINY, "--num-prompts", "6", "--input-len", "20", "--output-len", "6",
             "--random-range-ratio", "0.5", "--random-prefix-len", "4", "--seed", "5", "--disable-tqdm",
             "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    want = random_requests(6, 20, 6, VOCAB, 0.5, 4, seed=5)
    res = json.loads(out.read_text())
    assert res["num_requests"] == 6
    assert res["num_prompt_tokens"] == sum(len(q.prompt_token_ids) for q in want)
    assert res["num_output_tokens"] == sum(q.output_len for q in want)  # ignore_eos: exactly as drawn
    assert res["total_num_tokens"] == res["num_prompt_tokens"] + res["num_output_tokens"]
    assert res["tokens_per_second"] == pytest.approx(res["total_num_tokens"] / res["elapsed_time"])
    line = next(x for x in r.stdout.splitlines() if x.startswith("Throughput: "))
    assert f"{res['requests_per_second']:.2f} requests/s" in line and "output tokens/s" in line
    assert f"Total num output tokens:  {res['num_output_tokens']}" in r.stdout


def test_latency_times_each_iteration(tmp_path):
    out = tmp_path / "l.json"
    r = _cli("latency", *TINY, "--batch-size", "3", "--input-len", "8", "--output-len", "5",
             "--num-iters-warmup", "1", "--num-iters", "4", "--n", "2", "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert len(res["latencies"]) == 4 and all(x > 0 for x in res["latencies"])
    assert res["avg_latency"] == pytest.approx(sum(res["latencies"]) / 4)
    assert min(res["latencies"]) <= res["percentiles"]["50"] <= max(res["latencies"])
    assert f"Avg latency: {res['avg_latency']} seconds" in r.stdout


@pytest.mark.parametrize("args, flag", [
    (["throughput", *TINY, "--dataset-name", "sharegpt"], "--dataset-path"),
    (["throughput", *TINY, "--dataset-name", "sharegpt", "--dataset-path", "/nonexistent.json"], "--dataset-path"),
    (["throughput", *TINY, "--dataset-name", "alpaca"], "--dataset-name"),
    (["throughput", *TINY, "--random-range-ratio", "1.5", "--num-prompts", "2"], "--random-range-ratio"),
    (["latency", *TINY, "--num-iters", "0"], "--num-iters"),
    (["serve", "--request-rate", "0"], "--request-rate"),
    (["serve", "--dataset-name", "sharegpt"], "--dataset-path"),
    (["serve", "--goodput", "ttft"], "--goodput"),
    (["serve", "--goodput", "ttft:50", "speed:3"], "--goodput"),
    (["serve", "--goodput", "tpot:-1"], "--goodput"),
    (["serve", "--percentile-metrics", "ttft,speed"], "--percentile-metrics"),
    (["serve", "--max-concurrency", "0"], "--max-concurrency"),
    (["serve", "--port", "9", "--ready-check-timeout-sec", "0"], "--base-url"),
])
def test_bad_flags_are_named(args, flag):
    r = _cli(*args)
    assert r.returncode == 2 and flag in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


class WordTokenizer:
    """One id per whitespace-separated word (ids are word lengths): counts anyone can check."""

    def encode(self, text):
        return [len(w) for w in text.split()]


def _sharegpt(path, pairs):
    path.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": p},
                                                                 {"from": "gpt", "value": c}]}
                                for i, (p, c) in enumerate(pairs)] + [{"conversations": [{"value": "one turn"}]}]))
    return str(path)


def test_sharegpt_dataset_follows_vllms_filters(tmp_path):
    words = lambda n: " ".join(["w"] * n)  # noqa: E731
    path = _sharegpt(tmp_path / "sg.json", [
        (words(10), words(6)),     # kept
        (words(3), words(6)),      # prompt under 4 tokens
        (words(10), words(2)),     # completion under 4 tokens
        (words(1100), words(6)),   # prompt over 1024
        (words(1000), words(1100)),  # together over 2048
        (words(20), words(30)),    # kept
    ])
    reqs = sharegpt_requests(path, 2, WordTokenizer(), seed=1)
    assert sorted((len(r.prompt_token_ids), r.output_len) for r in reqs) == [(10, 6), (20, 30)]
    # a fixed output length: the short completion and the 1000 + 1100 pair (now 1000 + 3) count
    fixed = sharegpt_requests(path, 6, WordTokenizer(), output_len=3, seed=1)
    assert len(fixed) == 6 and {r.output_len for r in fixed} == {3}  # 4 usable pairs, drawn again to 6
    assert sorted({len(r.prompt_token_ids) for r in fixed}) == [10, 20, 1000]
    assert sharegpt_requests(path, 6, WordTokenizer(), output_len=3, seed=1) == fixed
    with pytest.raises(ValueError, match="--dataset-path"):
        sharegpt_requests(str(tmp_path / "missing.json"), 2, WordTokenizer())
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="--dataset-path"):
        sharegpt_requests(str(tmp_path / "bad.json"), 2, WordTokenizer())


def test_throughput_on_a_sharegpt_file(tmp_path):
    from compilelm.llm import LLM

    pairs = [("Tell me about the sea and its tides in a few words", "The sea rises and falls twice a day."),
             ("List three colours please", "Red, green and blue are three colours."),
             ("Hi", "Hello there, friend.")]  # the last prompt is under 4 tokens
    path = _sharegpt(tmp_path / "sg.json", pairs)
    out = tmp_path / "t.json"
    r = _cli("throughput", *TINY, "--dataset-name", "sharegpt", "--dataset-path", path, "--num-prompts", "2",
             "--disable-tqdm", "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    tok = LLM("dummy:smollm2-135m", enforce_eager=True, max_model_len=256, num_kv_blocks=64).get_tokenizer()
    want = sharegpt_requests(path, 2, tok)
    res = json.loads(out.read_text())
    assert res["num_requests"] == 2
    assert res["num_prompt_tokens"] == sum(len(q.prompt_token_ids) for q in want)
    assert res["num_output_tokens"] == sum(q.output_len for q in want)


def test_goodput_counts_the_requests_that_meet_every_objective():
    from compilelm.entrypoints.bench.serve import RequestResult, parse_goodput, summarize

    slos = parse_goodput(["ttft:100", "tpot:20"])
    assert slos == {"ttft": 100.0, "tpot": 20.0}
    results = [
        RequestResult(ok=True, output_tokens=11, ttft=0.05, latency=0.05 + 10 * 0.015),  # meets both
        RequestResult(ok=True, output_tokens=11, ttft=0.15, latency=0.15 + 10 * 0.015),  # TTFT too long
        RequestResult(ok=True, output_tokens=11, ttft=0.05, latency=0.05 + 10 * 0.025),  # TPOT too long
        RequestResult(ok=True, output_tokens=1, ttft=0.09, latency=0.09),  # one token: TPOT 0, meets
        RequestResult(ok=False, error="boom"),  # failed: never good
    ]
    summary = summarize(results, 2.0, ["ttft"], [99.0], slos)
    assert summary["request_goodput"] == pytest.approx(2 / 2.0)
    assert summary["request_throughput"] == pytest.approx(4 / 2.0)
    assert "request_goodput" not in summarize(results, 2.0, ["ttft"], [99.0])
    assert summarize(results, 2.0, ["ttft"], [99.0], {"e2el": 250.0})["request_goodput"] == pytest.approx(2 / 2.0)
