"""CPU smoke tests of the benchmarks that are cheap enough for CI (tiny model, eager)."""

import json

import pytest

from benchmarks import bench_throughput, bench_vs_vllm


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


def test_passes_end_to_end_measures_each_engine_once(tmp_path, monkeypatch):
    """bench_passes (b) on CPU, 1 layer: two cases of one model share the all-on engine's
    measurements (3 engines, not 4), each engine is measured `--rounds` times, and the rows carry
    the medians. (Run in this process: run_isolated is replaced, so the counting wrappers see the
    calls; test_run_isolated covers the process.)"""
    from benchmarks import bench_passes
    built, measured = [], []
    build, measure = bench_passes.build_engine, bench_passes.measure

    def counting_build(model, quant, off, args, custom=None):
        built.append(off)
        llm, info = build(model, quant, off, args, custom)
        llm.engine.setting = off
        return llm, info

    def recording_measure(engine, args):
        measured.append(engine.setting)
        return measure(engine, args)

    monkeypatch.setattr(bench_passes, "build_engine", counting_build)
    monkeypatch.setattr(bench_passes, "measure", recording_measure)
    monkeypatch.setattr(bench_passes, "run_isolated", lambda fn, *args: fn(*args))
    payload = bench_passes.main(["--device", "cpu", "--no-pieces", "--e2e", "--cases", "residual add out of addmm",
                                 "route_linear", "--layers", "1", "--batches", "1", "--context", "16", "--steps", "2",
                                 "--prefill", "32", "--rounds", "2", "--out", str(tmp_path / "passes.json")])
    assert built == [None, "unfuse_residual_addmm", "route_linear"]
    assert measured == [None, None, "unfuse_residual_addmm", "unfuse_residual_addmm", "route_linear", "route_linear"]
    rows = payload["e2e_rows"]
    assert {r["measure"] for r in rows} == {"decode_b1_ms", "prefill_32_ms"} and len(rows) == 4
    assert all(r["rounds"] == 2 and r["on_ms"] > 0 and r["off_ms"] > 0 and r["matches_on"] == 0 for r in rows)


def test_passes_end_to_end_measures_a_custom_pass(tmp_path, monkeypatch):
    """bench_passes --custom-pass on CPU, 1 layer: the docs' example pass, with vs without it on top
    of the built-in passes; it matches in the "on" engine only (fresh compile caches), and with
    --custom-pass alone no built-in case runs."""
    from benchmarks import bench_passes

    monkeypatch.setattr(bench_passes, "run_isolated", lambda fn, *args: fn(*args))
    payload = bench_passes.main(["--device", "cpu", "--no-pieces", "--e2e", "--custom-pass",
                                 "examples.my_fusion_pass:MeanSquareFusionPass", "--layers", "1", "--batches", "1",
                                 "--context", "16", "--steps", "2", "--prefill", "32", "--rounds", "1",
                                 "--out", str(tmp_path / "passes.json")])
    rows = payload["e2e_rows"]
    assert {r["fusion"] for r in rows} == {"MeanSquareFusionPass"} and len(rows) == 2
    assert all(r["matches_on"] > 0 and r["matches_off"] == 0 and r["model"] == "smollm2-135m" for r in rows)


def test_run_isolated():
    """bench_passes.run_isolated runs the function in another process and returns its result; an
    exception there, or a process that dies, is raised here."""
    import os

    from benchmarks import bench_passes

    assert bench_passes.run_isolated(os.getpid) != os.getpid()
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        bench_passes.run_isolated(divmod, 1, 0)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        bench_passes.run_isolated(os._exit, 3)


def test_decode_timing_keeps_every_request_decoding():
    """bench_decode.time_ours times steps that decode all `batch` requests: with prompts prefilled
    in several chunks the first requests run ahead, and max_tokens must cover that spread (at
    steps + 8, the first requests finished inside the timed window, and the graph then replayed
    alone read a smaller step's inputs). Checked through the engine's running requests, and
    against max_tokens = steps + 8, which must fail here."""
    from benchmarks import bench_decode
    from compilelm import LLM, SamplingParams

    batch, context, steps, chunk = 8, 48, 6, 32  # 8 prompts of 21 tokens: 7 prefill steps
    llm = LLM("dummy:smollm2-135m", model_overrides={"num_hidden_layers": 1}, enforce_eager=True,
              max_model_len=context + bench_decode.decode_tokens(batch, context, steps, chunk),
              max_num_seqs=batch, max_num_batched_tokens=chunk)
    engine = llm.engine
    timing = bench_decode.time_ours(engine, batch, context, steps)
    assert timing["ours_ms"] > 0 and timing["graph_replay_ms"] is None and not engine.has_unfinished_requests()
    # the timed steps attend `context` keys a sequence on average (the roofline's bytes), measured
    # from the engine's running requests; prompts were shorter, and decoding filled the difference
    assert abs(timing["step_context"] - context) <= 1, timing
    assert bench_decode.prompt_len(batch, context, steps, chunk) < context - steps // 2

    # the same warm-up and timed loop with max_tokens = steps + 8: a request stops decoding
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for p in bench_decode.prompts(batch, context, engine.model_config.vocab_size, seed=1000):  # (no cached prefix)
        engine.add_request(None, p, params)
    produced = {}
    while len(produced) < batch or min(produced.values()) < 3:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    for _ in range(steps):
        engine.step()
    assert engine.scheduler.num_running < batch


def startup_run(ready, **stages):
    """One of bench_compile's child-engine results, with the stages given (the rest 0)."""
    from benchmarks.bench_compile import STAGES

    return {"ready_s": ready, "num_graphs": 3, "stages": {k: stages.get(k, 0.0) for k in STAGES}}


def test_startup_rows_judge_compile_capture_and_ready():
    from benchmarks.bench_compile import startup_rows

    run = startup_run
    runs = {"cold": run(18.0, imports=3.0, dynamo=5.0, passes_lowering=3.0, inductor=2.5, capture=2.0),
            "warm": run(6.5, imports=3.5, cache_load=0.5, capture=1.5),
            "warm_ready_s": [6.0, 6.5, 7.2]}
    cold, warm = startup_rows("dummy:smollm2-135m", runs)
    assert cold["compile_capture_s"] == 12.5 and cold["met"] == "met" and cold["ready_met"] == "met"  # target 20
    assert warm["run"] == "warm (median of 3)"
    assert warm["compile_capture_s"] == 2.0 and warm["met"] == "met"  # target 5: compile + capture
    assert warm["ready_met"] == "MISSED" and (warm["min_s"], warm["max_s"]) == (6.0, 7.2)  # 6.5 s from process start
    (other,) = startup_rows("dummy:qwen3-0.6b", runs)[1:]  # no target: judged by neither
    assert "met" not in other and other["target_s"] is None


def test_summary_names_the_ab_rows(tmp_path):
    """scripts/gpu_bench.sh's summary: bench_decode's A/B rows (--pdl / --hopper-gemm both) are
    labelled, and judged against the target like the default rows."""
    from benchmarks.common import summary

    row = dict(model="dummy:llama-3.1-8b", batch=64, context=1024, roofline_ms=7.04, target_ms=8.8)
    rows = [dict(row, pdl=True, hopper_gemm=True, ours_ms=9.2), dict(row, pdl=True, hopper_gemm=False, ours_ms=9.5),
            dict(row, pdl=False, hopper_gemm=True, ours_ms=8.7)]
    (tmp_path / "bench_decode.json").write_text(json.dumps({"rows": rows}))
    got = {r["case"]: r["status"] for r in summary(str(tmp_path))}
    assert got == {"llama-3.1-8b b64 ctx1024": "MISSED", "llama-3.1-8b b64 ctx1024 cuBLAS": "MISSED",
                   "llama-3.1-8b b64 ctx1024 no PDL": "met"}


def test_summary_judges_startup_on_compile_and_capture(tmp_path):
    """The summary's compile rows: judged on compile + capture (bench_compile's `met`), with the
    process-start -> ready time and its own verdict beside it; an old row without
    compile_capture_s still prints."""
    from benchmarks.bench_compile import startup_rows
    from benchmarks.common import summary

    run = startup_run
    runs = {"cold": run(18.0, dynamo=5.0, inductor=2.5, capture=2.0), "warm": run(6.5, cache_load=0.5, capture=1.5),
            "warm_ready_s": [6.5]}
    rows = startup_rows("dummy:smollm2-135m", runs) + [{"model": "dummy:old", "run": "warm", "ready_s": 5.5}]
    (tmp_path / "bench_compile_gpu.json").write_text(json.dumps({"rows": rows}))
    got = {r["case"]: r for r in summary(str(tmp_path))}
    warm = got["smollm2-135m warm (median of 1)"]
    assert warm["value"] == "2.0 s compile+capture, 6.5 s ready" and warm["status"] == "met"
    assert warm["target/reference"] == "target 5.0 s (ready: MISSED)"
    assert got["smollm2-135m cold"]["value"] == "9.5 s compile+capture, 18.0 s ready"
    assert got["old warm"] == {**got["old warm"], "value": "5.5 s ready", "status": "-"}


def test_vs_vllm_runs_compilelm_alone_where_vllm_is_absent(tmp_path):
    """bench_vs_vllm without a vLLM site: one compilelm worker process per model, every metric
    measured, the ratio column empty (never a made-up peer number)."""
    out = tmp_path / "bench_vs_vllm.json"
    payload = bench_vs_vllm.main(["--models", "dummy:smollm2-135m", "--layers", "2", "--small", "--enforce-eager",
                                  "--decode", "1x16", "2x16", "--decode-steps", "2", "6",
                                  "--prefill", "2x16", "--repeat", "1", "--max-model-len", "128", "--online", "50",
                                  "--vllm-site", str(tmp_path / "no_vllm"), "--out", str(out)])
    (row,) = payload["rows"]
    assert payload["vllm"] is False and row["engine"] == "compilelm" and "error" not in row
    metrics = {"start_s", "decode_ms b1 c16", "decode_ms b2 c16", "prefill_tok_s 2x16",
               "throughput_tok_s nano-vllm", "throughput_tok_s long-prompt",
               "ttft_ms_p50 r50", "ttft_ms_p99 r50", "itl_ms_p50 r50", "itl_ms_p99 r50"}
    assert metrics <= set(row) and all(row[m] > 0 for m in metrics)
    assert row["ttft_ms_p50 r50"] <= row["ttft_ms_p99 r50"] and row["itl_ms_p50 r50"] <= row["itl_ms_p99 r50"]
    # the step limits each engine ran with are reported (on the CPU: 2048 tokens, 256 sequences)
    assert (row["max_num_batched_tokens"], row["max_num_seqs"]) == (2048, 256)
    assert {r["metric"] for r in payload["ratios"]} == metrics | {"max_num_batched_tokens", "max_num_seqs"}
    assert all(r["vllm"] is None and r["compilelm_advantage"] is None for r in payload["ratios"])
    assert json.loads(out.read_text())["benchmark"] == "bench_vs_vllm"


def test_vs_vllm_keeps_a_row_written_before_a_hung_exit(monkeypatch):
    """A worker that wrote its row and then hung in its exit (a TP rank's teardown) is killed at
    --timeout: its row counts, flagged; a worker that wrote nothing is an error row, and the
    driver goes on to the next engine either way."""
    import subprocess

    def worker(row):
        def run(cmd, env, timeout):
            if row is not None:
                with open(cmd[5], "w") as f:  # --worker ENGINE MODEL RESULT
                    json.dump(row, f)
            raise subprocess.TimeoutExpired(cmd, timeout)
        return run

    args = bench_vs_vllm.parse(["--timeout", "7"])
    monkeypatch.setattr(subprocess, "run", worker({"engine": "compilelm", "model": "m", "start_s": 1.0}))
    assert bench_vs_vllm.run_one("compilelm", "m", args) == {
        "engine": "compilelm", "model": "m", "start_s": 1.0, "exit": "timed out after 7 s"}
    monkeypatch.setattr(subprocess, "run", worker(None))
    assert bench_vs_vllm.run_one("compilelm", "m", args) == {
        "engine": "compilelm", "model": "m", "error": "timed out after 7 s"}


def test_vs_vllm_ratio_direction():
    """Advantage > 1 means compilelm ahead: a lower ms/step or start time, a higher tok/s."""
    same = {"quantization": "fp8", "kv_cache_dtype": "auto", "tensor_parallel_size": 1}  # settings, not metrics
    rows = [{"engine": "compilelm", "model": "m", **same, "decode_ms b1 c1000": 4.0, "prefill_tok_s 16x2000": 30.0},
            {"engine": "vllm", "model": "m", **same, "decode_ms b1 c1000": 5.0, "prefill_tok_s 16x2000": 40.0}]
    adv = {r["metric"]: r["compilelm_advantage"] for r in bench_vs_vllm.ratios(rows)}
    assert adv == {"decode_ms b1 c1000": 1.25, "prefill_tok_s 16x2000": 0.75}


def test_structured_cpu_smoke(tmp_path):
    """bench_structured's throughput half on CPU: both batches generate every token, the summary
    reads the ratio."""
    from benchmarks import bench_structured
    from benchmarks.common import summary

    out = tmp_path / "bench_structured.json"
    payload = bench_structured.main(["--enforce-eager", "--num-requests", "8", "--input-len", "8", "--output-len",
                                     "6", "--repeats", "1", "--skip-new-schema", "--out", str(out)])
    rows = payload["throughput"]
    assert [r["constrained"] for r in rows] == [0, 1] and rows[1]["ratio"] > 0
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "bench_structured" and saved["env"]["torch"]
    assert [r["case"] for r in summary(str(tmp_path)) if r["benchmark"] == "structured"] == [
        "1 in 8 constrained / none"]


def test_profile_masks_fills_agree(tmp_path):
    """profile_masks on the bundled tokenizer: the three ways of filling a step's masks give the
    same bits (the script raises otherwise), every cost is measured."""
    from benchmarks import profile_masks

    payload = profile_masks.main(["--rows", "3", "--steps", "12", "--out", str(tmp_path / "pm.json")])
    assert set(payload["results"]) == {"per row", "executor", "mask thread", "accept", "one row"}
    assert all(r["median_us"] > 0 for r in payload["results"].values())
    assert json.loads((tmp_path / "pm.json").read_text())["benchmark"] == "profile_masks"


def test_vs_vllm_online_latency_against_a_hand_timed_engine(monkeypatch):
    """online(): TTFT counts from the request's (Poisson) arrival, queueing included; ITL is the gap
    between a stream's tokens, split evenly where one step returns several. A fake engine whose
    steps take a known time and return tokens on a known schedule gives the expected numbers."""
    clock = [0.0]
    monkeypatch.setattr(bench_vs_vllm.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench_vs_vllm.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    class Engine:  # every step takes 10 ms; a request's first step returns 1 token, the next ones 2
        def __init__(self):
            self.reqs = {}

        def add(self, request_id, prompt, max_tokens):
            self.reqs[request_id + "-x"] = [0, max_tokens]  # an engine that suffixes ids

        def step(self):
            clock[0] += 0.010
            outs = []
            for rid, r in list(self.reqs.items()):
                r[0] = min(r[1], r[0] + (1 if r[0] == 0 else 2))
                outs.append((rid, r[0], r[0] == r[1]))
                if r[0] == r[1]:
                    del self.reqs[rid]
            return outs

    got = bench_vs_vllm.online(Engine(), [[1]] * 3, [5, 5, 5], rate=0.5, seed=3)
    # arrivals seconds apart (rate 0.5/s): each request alone, its first token one step after arrival
    # (+ up to one step of waiting where the arrival falls inside a step: never here, the engine idles)
    assert abs(got["ttft_ms_p50"] - 10.0) < 1e-6 and abs(got["ttft_ms_p99"] - 10.0) < 1e-6
    assert abs(got["itl_ms_p50"] - 5.0) < 1e-6 and abs(got["itl_ms_p99"] - 5.0) < 1e-6
    assert bench_vs_vllm.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    # three arrivals within the first step (1000/s): the two late ones wait for it to end and get
    # their first token one step later
    import random
    rng = random.Random(3)
    a = [rng.expovariate(1000.0)]
    a += [a[0] + rng.expovariate(1000.0)]
    a += [a[1] + rng.expovariate(1000.0)]
    assert a[2] < a[0] + 0.010
    clock[0] = 0.0
    got = bench_vs_vllm.online(Engine(), [[1]] * 3, [5, 5, 5], rate=1000.0, seed=3)
    want = sorted([10.0, (a[0] + 0.020 - a[1]) * 1e3, (a[0] + 0.020 - a[2]) * 1e3])
    assert abs(got["ttft_ms_p50"] - want[1]) < 1e-6
    assert abs(got["ttft_ms_p99"] - (want[1] + (want[2] - want[1]) * 0.98)) < 1e-6
