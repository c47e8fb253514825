"""The CUDA greedy path (runtime/sampler.py: argmax_rows, one kernel of csrc/cuda/argmax_kernels.cu)
picks what torch.argmax picks: random rows, ties within and across the kernel's 2048/8192-column
chunks, NaN, -inf rows, for the vocabularies of Llama-3 (128,256), SmolLM2 (49,152), Qwen3
(151,936) and odd sizes; in float32, bfloat16 and float16; on rows with a stride; called again
and replayed in a CUDA graph (the arrival counters return to zero). The same kernel's sampling
form (sample_rows, plain temperature sampling) draws tokens at softmax's frequencies, across its
chunks, in every dtype and load width, and its argmax rows are argmax_rows's."""

import pytest
import torch

from compilelm.ops import argmax_rows as op
from compilelm.ops import sample_rows
from compilelm.runtime.request import Request
from compilelm.runtime.sampler import Sampler, argmax_rows
from compilelm.sampling_params import SamplingParams

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


def frequencies(tokens: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.tensor([(tokens == i).sum().item() for i in ids], dtype=torch.float64) / tokens.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sample_rows_follows_softmax_across_chunks(dtype):
    """Qwen3's vocabulary with the mass on tokens in different 2048/8192-column chunks and in the
    row's last, partial chunk: 4096 rows draw them at softmax(x / T)'s frequencies."""
    vocab, rows, temperature = 151936, 4096, 0.8
    hot = [3, 2049, 70001, 151935]
    base = torch.full((vocab,), -30.0)
    base[hot] = torch.tensor([1.0, 0.3, -0.2, 0.6])
    x = base.to(dtype).cuda().expand(rows, -1).contiguous()
    tokens = sample_rows(x, torch.full((rows,), 1 / temperature, device="cuda"), keys(rows))
    assert set(tokens.unique().tolist()) <= set(hot)
    want = torch.softmax(x[0, hot].double().cpu() / temperature, -1)
    torch.testing.assert_close(frequencies(tokens.cpu(), hot), want, atol=0.03, rtol=0)


def test_sample_rows_flat_rows_are_uniform():
    rows, vocab = 8192, 50
    tokens = sample_rows(torch.zeros(rows, vocab, device="cuda"), torch.full((rows,), 1.0, device="cuda"), keys(rows))
    torch.testing.assert_close(frequencies(tokens.cpu(), list(range(vocab))),
                               torch.full((vocab,), 1 / vocab, dtype=torch.float64), atol=0.008, rtol=0)


def keys(rows: int, first: int = 0) -> torch.Tensor:
    return (torch.arange(first, first + rows, dtype=torch.int64, device="cuda") * 0x9E3779B9) ^ 0x5DEECE66D


def test_sample_rows_argmax_rows_keys_and_load_widths():
    x = logits(9, 151936)  # ties across chunks, a NaN row, an all -inf row
    inv_t = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 0.0, 0.5], device="cuda")
    got = sample_rows(x, inv_t, keys(9))
    greedy = (inv_t == 0).cpu()
    assert got.cpu()[greedy].tolist() == x.argmax(-1).cpu()[greedy].tolist()
    assert torch.equal(sample_rows(x, inv_t, keys(9)), got)  # same keys: same draw
    flat = torch.zeros(64, 5000, device="cuda")
    ones = torch.ones(64, device="cuda")
    assert not torch.equal(sample_rows(flat, ones, keys(64)), sample_rows(flat, ones, keys(64, 64)))
    # a column's noise depends on (row key, column) only: 16-byte or element loads, bf16 or fp32,
    # wide or narrow chunks, the row's place in the batch, the same draw
    y = logits(64, 128256 + 1, torch.bfloat16)[:, 1:]
    t64 = torch.full((64,), 1.3, device="cuda")
    same = sample_rows(y.contiguous(), t64, keys(64))
    assert torch.equal(sample_rows(y, t64, keys(64)), same)
    assert torch.equal(sample_rows(y.float(), t64, keys(64)), same)
    assert torch.equal(sample_rows(y[5:8].contiguous(), t64[:3], keys(64)[5:8]), same[5:8])
    torch.library.opcheck(torch.ops.compilelm.sample_rows.default, (y[:4].contiguous(), t64[:4], keys(4)))
    # a floor: the draw on the logits masked below it (x * inv_t < floor), in the same pass
    floor = torch.linspace(0.0, 3.0, 64, device="cuda")
    got = sample_rows(y, t64, keys(64), floor)
    masked = y.masked_fill(y.float() * t64.unsqueeze(1) < floor.unsqueeze(1), float("-inf"))
    assert torch.equal(got, sample_rows(masked, t64, keys(64)))
    drawn = y.float().gather(1, got.unsqueeze(1)).squeeze(1) * t64
    assert (drawn[3:] >= floor[3:]).all()  # (rows 0-2: ties, a NaN, -inf: logits())
    torch.library.opcheck(torch.ops.compilelm.sample_rows.default, (y[:4].contiguous(), t64[:4], keys(4), floor[:4]))


def test_sampler_top_k_top_p_rows_follow_the_renormalized_softmax():
    """Top-k and top-p rows (bf16 logits: the floor from each row's top tokens, sample_rows reads
    the logits once) draw at the frequencies of the kept tokens' renormalized softmax; min-p too."""
    vocab, n = 151936, 4000
    base = torch.full((vocab,), -30.0)
    hot = [7, 70000, 151935, 300]
    base[hot] = torch.tensor([1.0, 0.6, 0.2, -2.0])
    x = base.to(torch.bfloat16).cuda().expand(n, -1).contiguous()
    for kw, kept in ((dict(top_k=2), hot[:2]), (dict(top_k=20, top_p=0.7), hot[:2]), (dict(top_p=0.9), hot[:3]),
                     (dict(min_p=0.3), hot[:3])):
        reqs = [Request(str(i), [1], SamplingParams(temperature=1.0, **kw)) for i in range(n)]
        tokens = Sampler().sample_tensors(x.clone(), reqs).token_ids.cpu()
        assert set(tokens.tolist()) <= set(kept), kw
        want = torch.softmax(x[0, kept].double().cpu(), -1)
        torch.testing.assert_close(frequencies(tokens, kept), want, atol=0.04, rtol=0)


def test_sampler_takes_the_one_kernel_path_for_plain_rows():
    """A batch of greedy and temperature-only rows (bf16 logits, no fp32 copy) through the Sampler:
    greedy rows get the argmax, sampled rows softmax's frequencies; a top-p row sends the batch down
    the general path, which draws from the same distribution. Seeded rows draw the same tokens in
    any batch."""
    vocab, n = 1000, 3000
    base = torch.full((vocab,), -20.0)
    hot = [10, 500, 999]
    base[hot] = torch.tensor([0.5, 0.0, -0.5])
    x = base.to(torch.bfloat16).cuda().expand(n, -1).contiguous()
    plain = [Request(str(i), [1], SamplingParams(temperature=0.0 if i < 5 else 1.0)) for i in range(n)]
    assert all(r.plain_sample for r in plain)
    want = torch.softmax(x[0, hot].double().cpu(), -1)
    for reqs in (plain, plain[:-1] + [Request("p", [1], SamplingParams(temperature=1.0, top_p=0.999))]):
        tokens = Sampler().sample_tensors(x.clone(), reqs).token_ids.cpu()
        assert tokens[:5].tolist() == [10] * 5
        torch.testing.assert_close(frequencies(tokens[5:], hot), want, atol=0.04, rtol=0)
    seeded = [Request(f"s{i}", [1], SamplingParams(temperature=1.0, seed=i)) for i in range(400)]
    alone = Sampler().sample_tensors(x[:400].clone(), seeded).token_ids.cpu()
    mixed = Sampler().sample_tensors(x[:800].clone(), plain[:400] + seeded[::-1]).token_ids.cpu()
    assert mixed[400:].flip(0).tolist() == alone.tolist()
    torch.testing.assert_close(frequencies(alone, hot), want, atol=0.1, rtol=0)
