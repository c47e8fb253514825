"""The Triton prefill attention kernel (compilelm/ops/prefill_attention.py) run by Triton's CPU
interpreter against the plain-torch reference: mixed batches of fresh prefills, chunks after a
cached context, decode rows and padding, across GQA groups and tile shapes. The interpreter runs
the kernel's own code (loads, dots, masks, the tile numbering); the GPU tier runs it compiled.

Triton decides at import whether its jit functions (tl.zeros, tl.max, ...) are interpreted, so
this file's tests run in a child pytest started with TRITON_INTERPRET=1."""


import pytest
import torch

from compilelm.ops.attention import paged_attention_ref
from tests.triton_interpreter import INTERPRETED, run_interpreted

triton = pytest.importorskip("triton", minversion="3.7", reason="Triton >= 3.7 (its interpreter works with numpy 2.4)")

if not INTERPRETED:
    def test_kernel_under_the_triton_interpreter():
        run_interpreted(__file__)


@pytest.fixture(scope="module")
def interpreted():
    if not INTERPRETED:
        pytest.skip("runs in the child started by test_kernel_under_the_triton_interpreter")
    from compilelm.ops import prefill_attention
    return prefill_attention


def _batch(q_lens, contexts, heads, kv_heads, head_dim, page, dtype, padding=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, contexts)]
    blocks = [-(-s // page) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 4, generator=g) + 1  # shuffled pages; block 0 unused
    tables = torch.zeros(len(q_lens), max(blocks) + 2, dtype=torch.int32)  # rows longer than needed
    i = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = perm[i:i + n]
        i += n
    num_blocks = int(perm.max()) + 1
    kc = torch.randn(num_blocks, page, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, page, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens) + padding, heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, kc, vc, cu, torch.tensor(seq_lens, dtype=torch.int32), tables


CASES = [  # q_lens, contexts, heads, kv_heads, head_dim, page, config (BLOCK_M, BLOCK_N, warps, stages)
    ([1, 37, 5, 1, 70], [30, 3, 0, 100, 18], 8, 2, 64, 16, (64, 16, 4, 1)),  # group 4: 16 rows a tile
    ([33, 2, 1], [0, 40, 7], 4, 4, 32, 16, (32, 32, 4, 1)),  # no GQA; a tile crossing a sequence
    ([50, 1, 19], [70, 12, 0], 8, 1, 16, 8, (64, 16, 4, 1)),  # group 8 (MQA-like), 8-token pages
    ([64, 64], [0, 64], 4, 2, 64, 16, (32, 16, 4, 1)),  # tiles ending on page and tile boundaries
]


@pytest.mark.parametrize("dtype", [torch.float16])  # the interpreter's bf16 dots are wrong; GPU tier: bf16
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_prefill_rows_match_the_reference_and_others_are_untouched(interpreted, case, dtype):
    q_lens, contexts, heads, kv_heads, head_dim, page, config = case
    q, kc, vc, cu, seq_lens, tables = _batch(q_lens, contexts, heads, kv_heads, head_dim, page, dtype)
    out = torch.full_like(q, 7.0)
    interpreted.prefill_attention(out, q, kc, vc, cu, seq_lens, tables, head_dim ** -0.5, config=config)
    ref = paged_attention_ref(q, kc, vc, cu, seq_lens, tables, head_dim ** -0.5)
    for i, q_len in enumerate(q_lens):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if q_len > 1:
            torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=2e-2, rtol=2e-2)
        else:  # decode rows belong to paged_attention's decode kernel
            assert (out[rows] == 7.0).all()
    assert (out[int(cu[-1]):] == 7.0).all()  # padding rows too


def test_serves_only_cuda_steps_with_prefill_rows(interpreted):
    q, kc, *_ = _batch([4], [0], 4, 2, 64, 16, torch.bfloat16)
    assert not interpreted.serves(q, kc, 0)  # CPU tensors: the C++ kernels serve
    assert not interpreted.supported(q.float(), kc)


@pytest.mark.parametrize("case", CASES[:2], ids=["case0", "case1"])
def test_fp8_cache_matches_the_dequantizing_reference(interpreted, case):
    """An FP8 KV cache (float8_e4m3fn codes, per-tensor scales) is read as code * scale."""
    q_lens, contexts, heads, kv_heads, head_dim, page, config = case
    q, kc, vc, cu, seq_lens, tables = _batch(q_lens, contexts, heads, kv_heads, head_dim, page, torch.float16)
    k_scale, v_scale = 0.05, 0.2
    kc8 = (kc.float() / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    vc8 = (vc.float() / v_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = torch.full_like(q, 7.0)
    interpreted.prefill_attention(out, q, kc8, vc8, cu, seq_lens, tables, head_dim ** -0.5, config=config,
                                  k_scale=k_scale, v_scale=v_scale)
    ref = paged_attention_ref(q, kc8, vc8, cu, seq_lens, tables, head_dim ** -0.5, k_scale, v_scale)
    for i, q_len in enumerate(q_lens):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if q_len > 1:
            torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=2e-2, rtol=2e-2)
        else:
            assert (out[rows] == 7.0).all()


def test_a_step_with_long_rows_launches_the_long_tiles():
    """prefill_attention's launch: the default tiles, the long-row tiles where the step's longest
    sequence has LONG_KEYS keys or more (not for fp8 caches, not where the caller fixes a config)."""
    from compilelm.ops import prefill_attention as pa

    launches = []

    class Kernel:  # records the launch's tile constants
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"],
                                                        kw["num_stages"]))

    q, kc, vc, cu, seq_lens, tables = _batch([40, 1], [5000, 3], 8, 2, 128, 16, torch.float16)
    run = lambda cache, **kw: pa.prefill_attention(torch.empty_like(q), q, cache, cache, cu, seq_lens, tables, 0.1,  # noqa: E731
                                                   kernel=Kernel(), **kw)
    run(kc)
    run(kc, max_seq_len=pa.LONG_KEYS - 1)
    run(kc, max_seq_len=5040)
    run(kc.to(torch.float8_e4m3fn), max_seq_len=5040)
    run(kc, max_seq_len=5040, config=(32, 32, 4, 1))
    assert launches == [pa.CONFIGS[128], pa.CONFIGS[128], pa.LONG_CONFIGS[128], pa.CONFIGS[128], (32, 32, 4, 1)]
    assert pa.LONG_CONFIGS[128] != pa.CONFIGS[128]
