"""CUDA-graph choices made on the host: capture sizes, the full -> piecewise -> eager dispatch,
the memory reserve, and the decisions `prepare_step` sends to every rank (run on CPU with a
dispatcher set by hand; the steps themselves then run eagerly)."""

import dataclasses

import pytest

from compilelm import LLM, SamplingParams
from compilelm.graphs.config import CompileConfig
from compilelm.graphs.cudagraph.dispatch import CudaGraphDispatcher, default_capture_sizes, graph_sizes
from compilelm.models.config import dummy_config
from compilelm.runtime.memory import (
    FULL_GRAPH_BYTES,
    PIECE_GRAPH_BYTES,
    activation_bytes_per_token,
    cuda_memory_reserve,
)


def test_default_capture_sizes():
    sizes = default_capture_sizes()
    assert sizes[:5] == [1, 2, 4, 8, 16] and 256 in sizes and 264 not in sizes and 272 in sizes
    assert sizes[-1] == 512 and len(sizes) == 3 + 32 + 16


@pytest.mark.parametrize("mode,level,full,piecewise", [
    ("full_and_piecewise", 2, [1, 2, 4, 8, 16], [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ("piecewise", 1, [], [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ("full", 2, [1, 2, 4, 8, 16], []),
    ("none", 2, [], []),
    ("full_and_piecewise", 0, [1, 2, 4, 8, 16], []),  # -O0 has no pieces to capture
])
def test_graph_sizes_by_mode(mode, level, full, piecewise):
    """Full graphs hold at most max_num_seqs (16) tokens, piecewise ones the step budget (64)."""
    config = CompileConfig.for_level(level, cudagraph_mode=mode)
    assert graph_sizes(config, 16, 64) == (full, piecewise)


def test_graph_sizes_configured_and_none():
    config = CompileConfig(cudagraph_capture_sizes=[3, 100, 7, 1000])
    assert graph_sizes(config, 8, 512) == ([3, 7], [3, 7, 100])
    assert graph_sizes(None, 8, 512) == ([], [])


@pytest.mark.parametrize("num_tokens,num_seqs,expected", [
    (1, 1, ("full", 1)),
    (3, 3, ("full", 4)),  # pure decode, padded to the next full size
    (8, 8, ("full", 8)),
    (9, 9, ("piecewise", 16)),  # decode past the largest full graph: piecewise
    (3, 2, ("piecewise", 4)),  # a prefill chunk beside a decode
    (17, 1, ("piecewise", 24)),
    (24, 5, ("piecewise", 24)),
    (25, 5, ("none", None)),  # past the largest piecewise size: eager
    (30, 30, ("none", None)),
])
def test_dispatch(num_tokens, num_seqs, expected):
    d = CudaGraphDispatcher(full_sizes=(1, 2, 4, 8), piecewise_sizes=(1, 2, 4, 8, 16, 24))
    assert d.dispatch(num_tokens, num_seqs) == expected


def test_dispatch_without_graphs():
    assert CudaGraphDispatcher().dispatch(4, 4) == ("none", None)
    assert CudaGraphDispatcher(full_sizes=(1, 2)).dispatch(2, 1) == ("none", None)
    assert CudaGraphDispatcher(piecewise_sizes=(4,)).dispatch(2, 2) == ("piecewise", 4)


def test_memory_reserve_counts_piecewise_graphs():
    """Piecewise graphs add their static attention-output copies (one [largest size, q width]
    buffer per layer), a larger pool (64 tokens instead of 16) and the graphs themselves."""
    mc = dummy_config("smollm2-135m")
    import torch

    from compilelm.llm import make_engine_config

    def reserve(mode):
        config = make_engine_config("dummy:smollm2-135m", max_model_len=256, max_num_seqs=16,
                                    max_num_batched_tokens=64, compilation_config={"cudagraph_mode": mode})
        return cuda_memory_reserve(mc, config, torch.bfloat16)

    act = activation_bytes_per_token(mc, torch.bfloat16)
    sizes = graph_sizes(CompileConfig(), 16, 64)[1]
    attn_copies = 64 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * 2
    assert reserve("full_and_piecewise") - reserve("full") == (
        act * (64 - 16) + attn_copies + PIECE_GRAPH_BYTES * len(sizes) * (mc.num_hidden_layers + 1))
    # full graphs 1..16: the pool, the graphs, their bf16 logits buffer (and under TP the gathered logits)
    assert reserve("full") - reserve("none") == act * 16 + FULL_GRAPH_BYTES * 5 + 16 * mc.vocab_size * 2 * 2


def test_prepare_step_dispatch_decisions():
    """Real schedules (prefill chunks, mixed steps, pure decode) get the decisions of the rule:
    pure decode -> full graph of the next size; up to 16 tokens -> piecewise; else eager."""
    llm = LLM("dummy:smollm2-135m", model_overrides={"num_hidden_layers": 2}, max_model_len=256,
              num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, enforce_eager=True)
    runner = llm.engine.model_runner
    runner.dispatcher = CudaGraphDispatcher(full_sizes=(1, 2, 4), piecewise_sizes=(1, 2, 4, 8, 16))
    seen, prepare = [], runner.prepare_step

    def record(sched):
        step = prepare(sched)
        seen.append((len(step.batch.input_ids), len(step.batch.seq_lens), step.graph_mode, step.graph_size))
        return dataclasses.replace(step, graph_mode="none", graph_size=None)  # no graphs on CPU

    runner.prepare_step = record
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[5] * 3, list(range(100, 160)), [7] * 5], params, use_tqdm=False)
    for tokens, seqs, mode, size in seen:
        if tokens == seqs and tokens <= 4:
            assert (mode, size) == ("full", {1: 1, 2: 2, 3: 4, 4: 4}[tokens])
        elif tokens <= 16:
            assert mode == "piecewise" and size == min(s for s in (1, 2, 4, 8, 16) if s >= tokens)
        else:
            assert (mode, size) == ("none", None)
    modes = {mode for _, _, mode, _ in seen}
    assert modes == {"full", "piecewise", "none"}, seen
    # a step mixing the long prompt's last chunk with two decodes went piecewise
    assert any(mode == "piecewise" and tokens > seqs > 1 for tokens, seqs, mode, _ in seen), seen


def test_input_buffers_pack_a_step_at_fixed_offsets():
    """One copy carries a step: the views hold the batch padded as the kernels expect (slot -1,
    cu_seqlens_q repeated, null-block tables) and sit at the same addresses whenever the padded
    sizes are the same (what a replayed graph reads); `in_place` leaves the first input ids as
    they are on the device (a full graph's argmax)."""
    import numpy as np
    import torch

    from compilelm.graphs.step_inputs import HostBatch, InputBuffers

    buffers = InputBuffers(max_tokens=16, max_seqs=4, max_blocks=3, device=torch.device("cpu"))

    def batch(ids):
        n = len(ids)
        return HostBatch(input_ids=np.array(ids), positions=np.arange(n) + 5, slot_mapping=np.arange(n) + 40,
                         cu_seqlens_q=np.arange(n + 1, dtype=np.int32), seq_lens=np.arange(n, dtype=np.int32) + 6,
                         block_tables=np.arange(n * 2, dtype=np.int32).reshape(n, 2) + 1,
                         logits_idx=np.arange(n), max_query_len=1)

    first = buffers.load(batch([7, 8]), 4, 4, 3, pending=(np.array([1]), np.array([0])))
    ids, pos, meta, logits_idx, (rows, src) = first
    assert ids.tolist() == [7, 8, 0, 0] and pos.tolist() == [5, 6, 0, 0]
    assert meta.slot_mapping.tolist() == [40, 41, -1, -1] and logits_idx.tolist() == [0, 1]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 2, 2] and meta.seq_lens.tolist() == [6, 7, 0, 0]
    assert meta.block_tables.tolist() == [[1, 2, 0], [3, 4, 0], [0, 0, 0], [0, 0, 0]]
    assert rows.tolist() == [1] and src.tolist() == [0]
    second = buffers.load(batch([9, 10, 11]), 4, 4, 3)  # same padded sizes, the other host twin
    assert second[0].tolist() == [9, 10, 11, 0] and second[4] is None
    for a, b in zip((*first[:2], first[3]), (*second[:2], second[3])):
        assert a.data_ptr() == b.data_ptr()
    for name in ("slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables"):
        assert getattr(first[2], name).data_ptr() == getattr(second[2], name).data_ptr()
    assert second[2].cu_seqlens_q.dtype == torch.int32 and second[2].block_tables.dtype == torch.int32
    assert second[2].block_tables.tolist() == [[1, 2, 0], [3, 4, 0], [5, 6, 0], [0, 0, 0]]
    second[0][:2] = torch.tensor([70, 71])  # as a full graph's argmax would
    third = buffers.load(batch([1, 2, 3]), 4, 4, 3, in_place=2)
    assert third[0].tolist() == [70, 71, 3, 0] and third[1].tolist() == [5, 6, 7, 0]
    assert third[2].seq_lens.tolist() == [6, 7, 8, 0]
    # a larger step packs its fields at other offsets, the int32 ones as int32
    big = buffers.load(batch([10, 11, 12, 13]), 16, 4, 3)
    assert big[0].tolist() == [10, 11, 12, 13] + [0] * 12 and big[2].slot_mapping.tolist()[3:5] == [43, -1]
    assert big[2].seq_lens.tolist() == [6, 7, 8, 9] and big[2].block_tables[3].tolist() == [7, 8, 0]
    assert big[2].cu_seqlens_q.data_ptr() != first[2].cu_seqlens_q.data_ptr()
    # every field starts 16-byte aligned (a compiled piece copies a misaligned input before each call)
    for step in (first, second, big, buffers.load(batch([1, 2, 3]), 3, 3, 3, pending=(np.array([1]), np.array([0])))):
        ids, pos, meta, logits_idx, pending = step
        tensors = [ids, pos, logits_idx, meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables]
        assert all(t.data_ptr() % 16 == 0 for t in tensors + list(pending or ()))
