"""CPU smoke tests of the benchmarks that are cheap enough for CI (tiny model, eager)."""

import json

from benchmarks import bench_throughput


def test_workload_is_seeded_and_in_range():
    prompts, out_lens = bench_throughput.workload(32, 100, 1024, vocab=49152, seed=0)
    again, _ = bench_throughput.workload(32, 100, 1024, vocab=49152, seed=0)
    assert prompts == again
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in out_lens)
    assert all(0 <= t < 10000 for p in prompts for t in p)
    assert len(set(map(len, prompts))) > 1 and len(set(out_lens)) > 1


def test_throughput_cpu_smoke(tmp_path):
    out = tmp_path / "bench_throughput.json"
    payload = bench_throughput.main(["--models", "dummy:smollm2-135m", "--num-requests", "5", "--max-len", "12",
                                     "--layers", "2", "--enforce-eager", "--hf-batch", "2", "--out", str(out)])
    ours, hf = payload["rows"]
    _, out_lens = bench_throughput.workload(5, 6, 12, vocab=49152, seed=0)
    # every request produced exactly its drawn output length (ignore_eos, max_tokens)
    assert "error" not in ours and ours["output_tokens"] == sum(out_lens)
    # HF counts only each request's own tokens; it generated more (each batch runs to its longest)
    assert hf["output_tokens"] == sum(out_lens)
    expected_hf = sum(len(out_lens[i:i + 2]) * max(out_lens[i:i + 2]) for i in range(0, 5, 2))
    assert hf["hf_generated_tokens"] == expected_hf >= sum(out_lens)
    assert ours["output_tok_s"] > 0 and ours["speedup_vs_hf"] == ours["output_tok_s"] / hf["output_tok_s"]
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "bench_throughput" and saved["env"]["torch"] and len(saved["rows"]) == 2
