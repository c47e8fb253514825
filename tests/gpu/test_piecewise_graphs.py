"""Piecewise CUDA graphs on a GPU: the compiled pieces replayed per padded batch size, attention
eager between them.

Small Llama-3 and Qwen3 shaped models (4 layers, random weights; fp32 so that greedy tokens
compare exactly) run mixed prefill + decode steps, chunked prefills and prefix-cache hits through
the piecewise graphs, and must give eager's tokens and logprobs; the piecewise path must really be
taken (replays counted), with every replay's input addresses checked (DEBUG logging).
"""

import gc
import logging

import numpy as np
import pytest
import torch

from compilelm import LLM, SamplingParams
from compilelm.graphs.cudagraph.piecewise import PiecewiseGraphs
from compilelm.graphs.step_inputs import HostBatch
from compilelm.runtime.model_runner import StepInputs
from tests.gpu.test_engine_gpu import build_hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

SIZES = [1, 2, 4, 8, 16, 32, 64]
PREFIX = list(range(10, 58))  # 48 tokens: 3 full blocks, cached by the first request


def prompts():
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(3, 1000, (n,), generator=g).tolist()  # noqa: E731
    return [rand(7), PREFIX + rand(20), rand(90), rand(12), PREFIX + rand(5), rand(150)]


def make_llm(path, **kwargs):
    return LLM(model=str(path), dtype="float32", device="cuda", max_model_len=256, max_num_seqs=16,
               max_num_batched_tokens=64, num_kv_blocks=128, **kwargs)


def generate(llm):
    """The prefix's request alone first (its blocks get cached), then six requests together: a
    64-token budget mixes prefill chunks with decodes, and two prompts hit the cached prefix."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    first = llm.generate([PREFIX + [5, 6]], params, use_tqdm=False)
    rest = llm.generate(prompts(), params, use_tqdm=False)
    outs = [o.outputs[0] for o in first + rest]
    tokens = [o.token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]
    return tokens, logprobs, [o.num_cached_tokens for o in rest]


def record_dispatch(runner) -> list:
    seen, prepare = [], runner.prepare_step

    def record(sched):
        step = prepare(sched)
        seen.append((len(step.batch.input_ids), len(step.batch.seq_lens), step.graph_mode, step.graph_size))
        return step

    runner.prepare_step = record
    return seen


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One compile cache for the module: each shape compiles cold once."""
    return str(tmp_path_factory.mktemp("compile_cache"))


@pytest.fixture
def debug_addresses():
    """DEBUG logging at capture turns on the input-address check of every replay."""
    log = logging.getLogger("compilelm.graphs.cudagraph.piecewise")
    old = log.level
    log.setLevel(logging.DEBUG)
    yield
    log.setLevel(old)


@pytest.mark.parametrize("shape,mode", [("llama3", "piecewise"), ("qwen3", "piecewise"),
                                        ("llama3", "full_and_piecewise")])
def test_piecewise_matches_eager(shape, mode, tmp_path, cache_dir, debug_addresses):
    build_hf_model(shape, tmp_path / "model")
    llm = make_llm(tmp_path / "model", enforce_eager=True)
    eager_tokens, eager_logprobs, eager_cached = generate(llm)
    del llm
    gc.collect()
    torch.cuda.empty_cache()

    llm = make_llm(tmp_path / "model", compilation_config={
        "cache_dir": cache_dir, "cudagraph_mode": mode, "cudagraph_capture_sizes": SIZES})
    runner = llm.engine.model_runner
    pw = runner.piecewise_graphs
    assert pw.debug and len(pw.sites) == 5  # 4 layers -> 5 pieces
    seen = record_dispatch(runner)
    tokens, logprobs, cached = generate(llm)

    assert eager_cached == cached and cached[1] >= 32 and cached[4] >= 32  # prefix-cache hits
    assert tokens == eager_tokens
    for got, want in zip(logprobs, eager_logprobs):
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
    piecewise = [s for s in seen if s[2] == "piecewise"]
    assert pw.num_replays == 5 * len(piecewise)
    assert any(tokens > seqs > 1 for tokens, seqs, _, _ in piecewise), seen  # mixed prefill + decode
    assert any(tokens == 64 for tokens, _, _, _ in piecewise), seen  # a step of the whole budget
    assert {size for *_, size in piecewise} <= set(SIZES)
    if mode == "full_and_piecewise":  # pure decode goes to the full graphs
        assert all(mode != "piecewise" or tokens != seqs for tokens, seqs, mode, _ in seen), seen
        assert any(mode == "full" for _, _, mode, _ in seen)
    else:
        assert all(mode == "piecewise" for _, _, mode, _ in seen), seen
    del llm, runner, pw
    gc.collect()
    torch.cuda.empty_cache()


def test_padding_rows_write_no_kv(tmp_path, cache_dir):
    """Decoding together (padded to 8, 16, ...) gives each request's tokens when run alone, and a
    step whose 3 real rows are padded to 64 leaves every KV-cache byte as it was when its real
    rows write nowhere (slot -1): the padding rows never write the cache."""
    build_hf_model("llama3", tmp_path / "model")
    llm = make_llm(tmp_path / "model", compilation_config={
        "cache_dir": cache_dir, "cudagraph_mode": "piecewise", "cudagraph_capture_sizes": SIZES})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts()]
    assert together == alone

    runner = llm.engine.model_runner
    before = {name: (k.clone(), v.clone()) for name, (k, v) in runner.kv_caches.items()}
    batch = HostBatch(input_ids=np.array([5, 6, 7]), positions=np.array([0, 1, 2]), slot_mapping=-np.ones(3, np.int64),
                      cu_seqlens_q=np.array([0, 3], np.int32), seq_lens=np.array([3], np.int32),
                      block_tables=np.array([[1]], np.int32), logits_idx=np.array([2]), max_query_len=3)
    replays = runner.piecewise_graphs.num_replays
    logits = runner.run_step(StepInputs(batch, "piecewise", 64, 1))
    torch.cuda.synchronize()
    assert runner.piecewise_graphs.num_replays == replays + 5 and torch.isfinite(logits).all()
    for name, (k, v) in runner.kv_caches.items():
        assert torch.equal(k, before[name][0]) and torch.equal(v, before[name][1])
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()


def test_piece_graph_mechanics():
    """One piece, captured at 8 then 4 tokens: replays compute on new inputs; an input made
    eagerly (not a weight, not a graph output) is copied into a static buffer that the sizes
    share; an in-place input at another address is caught (debug); an uncaptured size raises."""
    w = torch.randn(16, 16, device="cuda")
    pw = PiecewiseGraphs([4, 8])
    pw.begin([w])
    pw.debug = True
    piece = pw.wrap("submod_0", lambda x, w: (torch.relu(x @ w), x.sum(0)))
    with torch.inference_mode():
        pw.capturing = True
        for n in (8, 4):
            with pw.at_size(n):
                piece(torch.randn(n, 16, device="cuda"), w)
        pw.capturing = False
        for n in (8, 4, 8):
            x = torch.randn(n, 16, device="cuda")
            with pw.at_size(n):
                out = piece(x, w)
            torch.testing.assert_close(out[0], torch.relu(x @ w))
            torch.testing.assert_close(out[1], x.sum(0))
        assert pw.num_replays == 3
        buf8, buf4 = (piece.graphs[n].copies[0][1] for n in (8, 4))
        assert buf4.data_ptr() == buf8.data_ptr() and buf4.shape == (4, 16)
        with pw.at_size(8), pytest.raises(RuntimeError, match="captured with"):
            piece(torch.randn(8, 16, device="cuda"), w.clone())
        with pw.at_size(2), pytest.raises(RuntimeError, match="no CUDA graph of 2 tokens"):
            piece(torch.randn(2, 16, device="cuda"), w)
        x = torch.randn(3, 16, device="cuda")  # outside a piecewise step: the piece itself
        torch.testing.assert_close(piece(x, w)[0], torch.relu(x @ w))
