"""The CUDA greedy path (runtime/sampler.py: argmax_rows, one kernel of csrc/cuda/argmax_kernels.cu)
picks what torch.argmax picks: random rows, ties within and across the kernel's 2048/8192-column
chunks, NaN, -inf rows, for the vocabularies of Llama-3 (128,256), SmolLM2 (49,152), Qwen3
(151,936) and odd sizes; in float32, bfloat16 and float16; on rows with a stride; called again
and replayed in a CUDA graph (the arrival counters return to zero)."""

import pytest
import torch

from compilelm.ops import argmax_rows as op
from compilelm.runtime.sampler import argmax_rows

pytestmark = pytest.mark.gpu


def logits(rows, vocab, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed + vocab + rows)
    x = torch.randn(rows, vocab, device="cuda", generator=g).to(dtype)
    if vocab > 2100:
        x[0, 5] = x[0, 2048 + 9] = 40.0  # a tie across chunks: the first wins
    if rows > 1:
        x[1, vocab // 2] = float("nan")
    if rows > 2:
        x[2] = float("-inf")
    if rows > 3 and vocab > 1:
        x[3, vocab - 2:] = 30.0  # a tie at the end of the row
    return x


@pytest.mark.parametrize("vocab", [1, 100, 2048, 2049, 49152, 128256, 151936])
@pytest.mark.parametrize("rows", [1, 2, 9, 64])
def test_argmax_rows_is_argmax_on_cuda(vocab, rows):
    x = logits(rows, vocab)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.tolist() == x.argmax(-1).tolist()
    if vocab > 2100:
        assert got[0].item() == 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_argmax_rows_half_dtypes(dtype):
    x = logits(5, 49152, dtype)
    assert op(x).tolist() == x.float().argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_argmax_rows_wide_chunks_and_unaligned_rows(dtype):
    """64 rows of Llama-3's vocabulary take 16-byte loads and 8192-column chunks; rows that start
    off 16-byte alignment take element loads."""
    x = logits(64, 128256, dtype)
    assert op(x).tolist() == x.float().argmax(-1).tolist()
    y = logits(64, 128256 + 1, dtype)[:, 1:]
    assert op(y).tolist() == y.float().argmax(-1).tolist()


def test_argmax_rows_strided_rows_and_opcheck():
    buf = logits(6, 4100 + 64)
    x = buf[:, :4100]  # rows 4164 apart
    assert op(x).tolist() == x.argmax(-1).tolist()
    torch.library.opcheck(torch.ops.compilelm.argmax_rows.default, (x,))
    with pytest.raises(RuntimeError, match="columns contiguous"):
        op(buf.t())


def test_argmax_rows_repeats_and_graph_replay():
    """The last block of each row resets its counter: repeated calls, and a graph replayed on new
    values, stay right."""
    x = logits(8, 128256)
    for _ in range(3):
        assert op(x).tolist() == x.argmax(-1).tolist()
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(static)  # warm-up outside capture (allocates the counters)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(static)
    for seed in range(4):
        static.copy_(logits(8, 128256, seed=seed + 1))
        graph.replay()
        assert out.tolist() == static.argmax(-1).tolist()
