"""Tensor parallel decode on 2 GPUs with full CUDA graphs and async scheduling.

Full decode graphs under TP capture the whole step: the forward with its all-reduces (the one-shot
kernel over peer memory, or NCCL below `custom_all_reduce_min_bytes`) and the LM head's all-gather,
then the greedy argmax. So a steady greedy decode step on rank 0 is one graph launch and no
collective called from the host, while the all-reduce kernels do run (inside the graph). Tokens:
async TP=2 with graphs == TP=1 eager (fp32, where TP=2's extra roundings are ~1e-7), and async ==
sync at TP=2 for seeded random sampling and for greedy constrained rows (rank 0 broadcasts those
ids).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (shared hosts)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32"),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]

MODEL = ("dummy:qwen3-0.6b", {"num_hidden_layers": 2, "vocab_size": 4096})
PROMPTS = [[11, 2, 30, 4, 500, 6, 7], [9, 99, 999], list(range(40, 80)), [5] * 20]

def _is_host_collective(name: str) -> bool:
    """A collective called from the host (c10d's and NCCL's record functions, our custom ops)."""
    lower = name.lower()
    return name.startswith(("nccl:", "c10d::")) or any(k in lower for k in ("all_reduce", "allreduce",
                                                                               "all_gather", "allgather"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One compile cache for the module: the TP=2 engines after the first load their pieces."""
    return tmp_path_factory.mktemp("tp_cache")


def _llm(tp: int, async_scheduling: bool, cache_dir, eager: bool = False, **kw):
    from compilelm.llm import LLM
    if eager:
        kw["enforce_eager"] = True
    else:
        kw["compilation_config"] = {"cache_dir": str(cache_dir), "cudagraph_mode": "full_and_piecewise",
                                    "cudagraph_capture_sizes": [1, 2, 4, 8]}
    return LLM(MODEL[0], model_overrides=MODEL[1], max_model_len=256, num_kv_blocks=128, device="cuda",
               dtype="float32", tensor_parallel_size=tp, async_scheduling=async_scheduling, **kw)


def _tokens(llm, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _mixed():
    from compilelm.sampling_params import SamplingParams
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    return [greedy, SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
            greedy, SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)]


def _decode_profile(llm, steps: int = 6) -> dict:
    """Rank 0 during `steps` steady greedy decode steps (every request in a full graph): graph
    replays, host-side collective ops, and all-reduce kernels that ran on the GPU."""
    from compilelm.sampling_params import SamplingParams
    engine = llm.engine
    runner = engine.model_runner
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for _ in range(8):  # prefill, then decode in flight
        engine.step()
    modes, replays = [], []
    run_step, replay = runner.run_step, runner.cuda_graphs.replay
    runner.run_step = lambda step: (modes.append(step.graph_mode), run_step(step))[1]
    runner.cuda_graphs.replay = lambda size: (replays.append(size), replay(size))[1]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    finally:
        del runner.run_step, runner.cuda_graphs.replay
    events = prof.events()
    host_collectives = [e.name for e in events
                        if e.device_type == torch.autograd.DeviceType.CPU and _is_host_collective(e.name)]
    kernels = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    engine.abort_request([f"p{i}" for i in range(len(PROMPTS))])
    while engine.has_unfinished_requests():
        engine.step()
    return {"modes": modes, "replays": replays, "host_collectives": host_collectives,
            "graph_launches": sum(e.name.startswith("cudaGraphLaunch") for e in events),
            "allreduce_kernels": [k for k in kernels if "nccl" in k.lower() or "one_shot" in k]}


def _greedy():
    """Greedy rows that finish at different steps: after one does, the others' pending rows no
    longer sit at the rows of the last step's output (the full graph's argmax is copied out of
    the input buffer before the next step's inputs overwrite it)."""
    from compilelm.sampling_params import SamplingParams
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (16, 5, 16, 9)]


@pytest.fixture(scope="module")
def tp1_tokens():
    ref = _llm(1, False, None, eager=True)
    try:
        return _tokens(ref, _greedy())
    finally:
        ref.engine.shutdown()


@pytest.mark.parametrize("min_bytes", [0, -1], ids=["one-shot", "nccl"])
def test_full_graph_decode_captures_the_collectives(min_bytes, cache_dir, tp1_tokens):
    """Every steady decode step is one full-graph replay with the all-reduces inside it: no
    collective is called from the host, yet all-reduce kernels run; tokens as eager TP=1."""
    llm = _llm(2, True, cache_dir, custom_all_reduce_min_bytes=min_bytes)
    try:
        assert llm.engine.async_scheduling  # the default on CUDA at any TP size
        graphed = _tokens(llm, _greedy())
        prof = _decode_profile(llm)
    finally:
        llm.engine.shutdown()
    assert prof["modes"] == ["full"] * len(prof["modes"]) and prof["modes"], prof["modes"]
    assert len(prof["replays"]) == len(prof["modes"]) == prof["graph_launches"], prof
    assert prof["host_collectives"] == [], prof["host_collectives"][:10]
    assert prof["allreduce_kernels"], "no all-reduce kernel ran: the graph lost its collectives"
    if min_bytes == 0:
        assert any("one_shot" in k for k in prof["allreduce_kernels"]), set(prof["allreduce_kernels"])
    assert graphed == tp1_tokens


def test_async_tp2_graphs_match_sync(cache_dir):
    """Seeded random + greedy + logprobs, the same compiled model and graphs: async TP=2 == sync
    TP=2, token for token (the random rows need rank 0's broadcast of its sampled ids)."""
    tokens = []
    for async_scheduling in (True, False):
        llm = _llm(2, async_scheduling, cache_dir)
        try:
            tokens.append(_tokens(llm, _mixed()))
        finally:
            llm.engine.shutdown()
    assert tokens[0] == tokens[1]


def test_async_tp2_graphs_constrained_greedy_rows_match_sync(tmp_path):
    """Greedy constrained rows next to plain greedy ones: rank 0 takes the masked rows' argmax
    into the full graph's input ids, in place, and broadcasts those ids; rank 1 decodes from the
    broadcast, not from its own (unmasked) argmax. Async == sync at TP=2, token for token."""
    pytest.importorskip("llguidance")
    import gzip
    import shutil

    from compilelm.llm import LLM
    from compilelm.sampling_params import SamplingParams
    from compilelm.sampling_params import StructuredOutputsParams as S
    src = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data", "smollm2_tokenizer")
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    shutil.copy(os.path.join(src, "tokenizer_config.json"), tok)
    with gzip.open(os.path.join(src, "tokenizer.json.gz"), "rb") as f, open(tok / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(f, out)
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}}
    params = [SamplingParams(max_tokens=24, temperature=0, structured_outputs=S(json=schema)),
              SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, structured_outputs=S(regex="[ab]{3,6}")),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)]
    results = []
    for async_scheduling in (True, False):
        llm = LLM("dummy:smollm2-135m", tokenizer=str(tok), tensor_parallel_size=2, device="cuda", dtype="float32",
                  async_scheduling=async_scheduling, max_model_len=256, num_kv_blocks=128,
                  model_overrides={"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                                   "head_dim": 64},
                  compilation_config={"cache_dir": str(tmp_path / "cache"), "cudagraph_mode": "full_and_piecewise",
                                      "cudagraph_capture_sizes": [1, 2, 4, 8]})
        try:
            outs = llm.generate(["A number:", [4, 5], "Letters:", [6, 7, 8, 9]], params, use_tqdm=False)
            results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        finally:
            llm.engine.shutdown()
    assert results[0] == results[1]
    assert [len(t) for t, _ in results[0][1::2]] == [16, 7]
