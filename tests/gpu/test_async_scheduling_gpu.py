"""Async scheduling on a GPU with CUDA graphs: the same tokens as the synchronous loop.

A tiny random-weight model (2 layers of SmolLM2-135M's shape), fp32, compiled, with full decode
graphs and piecewise graphs: the pending rows' input ids are scattered into the graphs' static
input buffer on the device, or, in steady greedy decode, are already there (the full graph's
argmax, written into its input ids); the sampled ids come back through pinned memory and an event.
"""

import gc

import pytest
import torch

from compilelm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

PROMPT_LENS = (7, 33, 90, 12, 150)


def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run(async_scheduling: bool, cache_dir, params_fn):
    llm = LLM("dummy:smollm2-135m", model_overrides={"num_hidden_layers": 2}, dtype="float32", device="cuda",
              max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64, async_scheduling=async_scheduling,
              compilation_config={"cache_dir": str(cache_dir), "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]})
    runner = llm.engine.model_runner
    assert llm.engine.async_scheduling is async_scheduling
    steps = []  # (graph mode, has pending rows)
    run_step = runner.run_step
    runner.run_step = lambda step: (steps.append((step.graph_mode, step.pending_rows is not None)),
                                    run_step(step))[1]
    prepare_inputs = runner.prepare_inputs
    in_place = []  # per step: how many leading input ids were left on the device
    runner.prepare_inputs = lambda *args: (in_place.append(args[-1]), prepare_inputs(*args))[1]
    outs = llm.generate(prompts(), [params_fn(i) for i in range(len(PROMPT_LENS))], use_tqdm=False)
    result = [[(c.token_ids, c.finish_reason,
                None if c.logprobs is None else [sorted(e) for e in c.logprobs]) for c in o.outputs]
              for o in outs]
    usage = llm.engine.kv_cache_manager.usage
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return result, [(m, p, n) for (m, p), n in zip(steps, in_place)], usage


def greedy(i):
    return SamplingParams(temperature=0.0, max_tokens=24 + 3 * i, ignore_eos=True)


def mixed(i):
    if i == 1:  # seeded sampling, n > 1, logprobs
        return SamplingParams(n=2, temperature=1.0, top_k=50, seed=5, max_tokens=20, ignore_eos=True, logprobs=3)
    if i == 3:  # penalties: synchronous steps while it runs
        return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3)
    return greedy(i)


@pytest.mark.parametrize("params_fn", [greedy, mixed])
def test_async_matches_sync_with_cuda_graphs(params_fn, tmp_path):
    sync, sync_steps, _ = run(False, tmp_path / "cache", params_fn)
    asyn, async_steps, usage = run(True, tmp_path / "cache", params_fn)
    assert asyn == sync
    assert usage == 0.0
    assert not any(p or n for _, p, n in sync_steps)
    # decodes launched before the previous tokens were on the host, through full graphs too,
    # some with their input ids left where the last full graph's argmax put them
    assert any(m == "full" and p for m, p, _ in async_steps)
    assert any(m == "full" and n > 0 for m, _, n in async_steps)
    assert {m for m, _, _ in async_steps} >= {"full", "piecewise"}


def test_stop_token_drops_the_in_flight_step(tmp_path):
    ref, _, _ = run(False, tmp_path / "cache", greedy)
    stops = [tokens[0][0][5] for tokens in ref]

    def with_stop(i):
        return SamplingParams(temperature=0.0, max_tokens=24 + 3 * i, ignore_eos=True, stop_token_ids=[stops[i]])

    sync, _, _ = run(False, tmp_path / "cache", with_stop)
    asyn, _, usage = run(True, tmp_path / "cache", with_stop)
    assert asyn == sync and usage == 0.0
    for i, (out, r) in enumerate(zip(asyn, ref)):
        tokens, reason, _ = out[0]
        full = r[0][0]
        assert tokens == full[:full.index(stops[i]) + 1] and reason == "stop"
