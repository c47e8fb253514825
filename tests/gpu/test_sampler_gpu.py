"""The CUDA greedy path (runtime/sampler.py: argmax_rows, two stages for a few long rows) picks
what torch.argmax picks on the GPU: random rows, ties within and across pieces, NaN, -inf rows,
for the vocabularies of Llama-3 (128,256), SmolLM2 (49,152) and Qwen3 (151,936)."""

import pytest
import torch

from compilelm.runtime.sampler import _argmax_chunk, argmax_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("vocab", [128256, 49152, 151936])
@pytest.mark.parametrize("rows", [1, 2, 8, 9])
def test_argmax_rows_is_argmax_on_cuda(vocab, rows):
    chunk = _argmax_chunk(vocab)
    g = torch.Generator(device="cuda").manual_seed(vocab + rows)
    x = torch.randn(rows, vocab, device="cuda", generator=g)
    x[0, 5] = x[0, chunk + 9] = 40.0  # a tie across pieces: the first wins
    if rows > 1:
        x[1, vocab // 2] = float("nan")
    if rows > 2:
        x[2] = float("-inf")
    assert argmax_rows(x).tolist() == x.argmax(-1).tolist()
    assert argmax_rows(x)[0].item() == 5
