"""The fused ops' schemas (csrc/ops.cpp) with their CPU implementations and fake impls
(compilelm/ops/): opcheck, and fused_add_rms_norm / rope_and_cache against the unfused layers."""

import pytest
import torch

from compilelm import ops
from compilelm.layers.layernorm import RMSNorm
from compilelm.layers.rotary_embedding import RotaryEmbedding
from compilelm.ops import quant as q_ops
from compilelm.ops.norm import rms_norm
from tests.test_ops import make_decode_step

OPS = torch.ops.compilelm


def rope_inputs(dtype, num_tokens=5, num_heads=4, num_kv_heads=2, head_size=64, qk_norm=False, seed=0):
    """Query/key/value as views of one fused qkv tensor (as the model hands them over), a cache with
    random contents, slots with a -1 (padding) row."""
    g = torch.Generator().manual_seed(seed)
    n, d = num_tokens, head_size
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * d, generator=g).to(dtype)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    rope = RotaryEmbedding(d, max_position=512, theta=10000.0)
    positions = torch.randint(0, 512, (n,), generator=g)
    num_blocks = max(8, n // 16 + 1)
    key_cache = torch.randn(num_blocks, 16, num_kv_heads, d, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, 16, num_kv_heads, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * 16, generator=g)[:n]
    if n > 1:
        slots[n // 2] = -1
    weights = (torch.rand(d, generator=g) + 0.5).to(dtype), (torch.rand(d, generator=g) + 0.5).to(dtype)
    q_w, k_w = weights if qk_norm else (None, None)
    return (positions, q.view(n, num_heads, d), k.view(n, num_kv_heads, d), v.view(n, num_kv_heads, d),
            rope.cos_sin_cache, q_w, k_w, 1e-6, key_cache, value_cache, slots)


def quant_cases(dtype):
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(6, 64, generator=g).to(dtype), torch.randn(6, 64, generator=g).to(dtype)
    w, scale = (torch.rand(64, generator=g) + 0.5).to(dtype), torch.tensor([0.01])
    return [
        (OPS.quant_fp8_per_token.default, (x,)),
        (OPS.quant_fp8_static.default, (x, scale)),
        (OPS.rms_norm_quant_fp8.default, (x, w, 1e-6, None)),
        (OPS.rms_norm_quant_fp8.default, (x, w, 1e-6, scale)),
        (OPS.fused_add_rms_norm_quant_fp8.default, (x, res, w, 1e-6, None)),
        (OPS.fused_add_rms_norm_quant_fp8.default, (x, res, w, 1e-6, scale)),
        (OPS.silu_mul_quant_fp8.default, (x, None)),
        (OPS.silu_mul_quant_fp8.default, (x, scale)),
        (OPS.fused_add_rms_norm.default, (x, res, w, 1e-6)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_cpu(dtype):
    for op, args in quant_cases(dtype):
        torch.library.opcheck(op, args)
    for qk_norm in (False, True):
        torch.library.opcheck(OPS.rope_and_cache.default, rope_inputs(dtype, qk_norm=qk_norm))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_is_the_layer(dtype):
    norm = RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, res = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    out, residual = ops.fused_add_rms_norm(x, res, norm.weight.detach(), 1e-5)
    want, want_residual = norm(x, res)
    assert torch.equal(out, want) and torch.equal(residual, want_residual)


def test_fused_quant_ops_equal_the_unfused_ops():
    x, res = torch.randn(6, 64).bfloat16(), torch.randn(6, 64).bfloat16()
    w = torch.rand(64).bfloat16() + 0.5
    q, s, r = q_ops.fused_add_rms_norm_quant_fp8(x, res, w, 1e-6, None)
    rq, rs = q_ops.quant_fp8_per_token(rms_norm(x + res, w, 1e-6))
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs) and torch.equal(r, x + res)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_cpu(qk_norm):
    """Rotated query returned, rotated key and value in their slots, every other cache row untouched."""
    args = rope_inputs(torch.float32, qk_norm=qk_norm)
    positions, q, k, v, cos_sin, q_w, k_w, eps, key_cache, value_cache, slots = args
    k_before, v_before = key_cache.clone(), value_cache.clone()
    out = ops.rope_and_cache(*args)
    n = q.shape[0]
    if qk_norm:  # Qwen3's q_norm / k_norm: RMSNorm over each head
        q, k = rms_norm(q, q_w, eps), rms_norm(k, k_w, eps)
    want_q, want_k = RotaryEmbedding(64, max_position=512, theta=10000.0)(positions, q.reshape(n, -1), k.reshape(n, -1))
    assert out.is_contiguous() and torch.equal(out, want_q.view(n, -1, 64))
    written = slots >= 0
    rows_k, rows_v = key_cache.view(-1, 2, 64), value_cache.view(-1, 2, 64)
    assert torch.equal(rows_k[slots[written]], want_k.view(n, -1, 64)[written])
    assert torch.equal(rows_v[slots[written]], v[written])
    untouched = torch.ones(rows_k.shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.equal(rows_k[untouched], k_before.view(-1, 2, 64)[untouched])
    assert torch.equal(rows_v[untouched], v_before.view(-1, 2, 64)[untouched])


def test_rope_paged_attention_cpu():
    """The one op == rope_and_cache, then paged_attention of the rotated query (its CPU kernel is
    that composition; the CUDA kernel is held to it in tests/gpu/test_rope_attention_kernel.py),
    and ~ the reference; the caches hold the rotated key and the value at the new slots."""
    args = make_decode_step((1, 40, 100), num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32)
    positions, q, k, v, cos_sin, key_cache, value_cache, slots, cu, seq_lens, tables, scale = args
    k2, v2 = key_cache.clone(), value_cache.clone()
    out = ops.rope_paged_attention(*args, 1)
    rotated = ops.rope_and_cache(positions, q, k, v, cos_sin, None, None, 0.0, k2, v2, slots)
    assert torch.equal(out, ops.paged_attention(rotated, k2, v2, cu, seq_lens, tables, scale, 1))
    assert torch.equal(key_cache, k2) and torch.equal(value_cache, v2)
    k3, v3 = k2.clone(), v2.clone()
    torch.testing.assert_close(out, ops.rope_paged_attention_ref(positions, q, k, v, cos_sin, k3, v3, slots, cu,
                                                                 seq_lens, tables, scale))
    torch.library.opcheck(OPS.rope_paged_attention.default, (*args, 1))


def test_linear_out_cpu():
    """linear_out (the full graphs' LM head) writes x @ weight.T into a row slice of a wider
    buffer, as linear computes it, and nothing else; opcheck; a wrong out is refused."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(100, 64, generator=g).to(torch.bfloat16)
    buffer = torch.full((5, 100), 7.0, dtype=torch.bfloat16)
    ops.linear_out(x, w, buffer[:3])
    torch.testing.assert_close(buffer[:3], ops.linear(x, w), rtol=0, atol=0)
    assert (buffer[3:] == 7.0).all()
    torch.library.opcheck(OPS.linear_out.default, (x, w, buffer[:3]))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.linear_out(x, w, torch.empty(3, 100))


def test_linear_argmax_out_cpu():
    """linear_argmax_out: the logits as linear_out writes them and each row's first maximum
    (a tie made on purpose goes to the lower column); opcheck; a wrong argmax buffer is refused."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(100, 64, generator=g).to(torch.bfloat16)
    first = int(ops.linear(x, w)[1].float().argmax())
    w[99] = w[first]  # row 1: the same maximum twice
    buffer = torch.full((5, 100), 7.0, dtype=torch.bfloat16)
    ids = torch.full((5,), -1, dtype=torch.int64)
    ops.linear_argmax_out(x, w, buffer[:3], ids[:3])
    want = ops.linear(x, w)
    torch.testing.assert_close(buffer[:3], want, rtol=0, atol=0)
    assert ids[:3].tolist() == [row.float().argmax().item() for row in want] and ids[1] == first
    assert (buffer[3:] == 7.0).all() and (ids[3:] == -1).all()
    torch.library.opcheck(OPS.linear_argmax_out.default, (x, w, buffer[:3], ids[:3]))
    with pytest.raises(RuntimeError, match="argmax must be"):
        ops.linear_argmax_out(x, w, buffer[:3], torch.empty(3, dtype=torch.int32))
