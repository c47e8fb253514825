"""The FP8 KV cache (--kv-cache-dtype fp8) on the CPU: the plain-torch reference of a quantized
write and read, the CPU kernels against it (reshape_and_cache, paged_attention, rope_and_cache,
rope_paged_attention), the ops' schemas (opcheck), the config and its flag, the cache's size, and
the engine's greedy output against the model-dtype cache."""

import argparse
import logging

import pytest
import torch

import compilelm.ops as ops
from compilelm import LLM, SamplingParams
from compilelm.config import CacheConfig
from compilelm.ops.attention import paged_attention_ref, reshape_and_cache_ref, rope_paged_attention_ref
from compilelm.ops.rope import FP8_KV_DTYPE, apply_rope, dequantize_kv, quantize_kv

FP8 = torch.float8_e4m3fn


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# -- the reference ------------------------------------------------------------------------------

def test_quantize_kv_is_the_saturating_scaled_cast():
    x = torch.tensor([0.0, 1.0, -3.3, 1000.0, -1e6, 0.0137, 447.9, 2.0 ** -10], dtype=torch.bfloat16)
    q = quantize_kv(x, FP8, 0.5)
    assert q.dtype == FP8
    want = (x.float() / 0.5).clamp(-448, 448).to(FP8)
    assert torch.equal(_codes(q), _codes(want))
    assert q.float()[3] == 448 and q.float()[4] == -448  # saturated, not NaN
    assert quantize_kv(x, torch.bfloat16, 0.5) is x  # model-dtype caches store x as it is
    # dequantized: code * scale, within e4m3's half-ulp (2^-4 relative) of the value
    back = dequantize_kv(q, 0.5)
    ok = x.float().abs() < 200
    assert torch.allclose(back[ok], x.float()[ok], rtol=2 ** -4, atol=2 ** -9 * 0.5)


# -- the CPU kernels against it -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.03, 0.5)])
def test_reshape_and_cache_quantizes_like_the_reference(dtype, scales):
    g = torch.Generator().manual_seed(0)
    n, kvh, d = 37, 2, 64
    key = (torch.randn(n, kvh, d, generator=g) * 4).to(dtype)
    value = torch.randn(n, kvh, d, generator=g).to(dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 3.0])  # saturates at +-448 * scale
    slots = torch.randperm(64, generator=g)[:n] + 16
    slots[[3, 20]] = -1
    caches = [torch.zeros(6, 16, kvh, d, dtype=FP8) for _ in range(4)]
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots, *scales)
    reshape_and_cache_ref(key, value, caches[2], caches[3], slots, *scales)
    assert torch.equal(_codes(caches[0]), _codes(caches[2])) and torch.equal(_codes(caches[1]), _codes(caches[3]))
    flat = caches[0].view(-1, kvh, d)
    assert (_codes(flat[slots[slots >= 0]]) != 0).any() and (_codes(flat[:16]) == 0).all()  # skipped / untouched


def kv_batch(q_lens, contexts, heads, kv_heads, d, page=16, dtype=torch.float32, seed=0, scales=(0.1, 0.02),
             device="cpu", pad=2):
    """A step's attention inputs over an fp8 cache: (q, key cache, value cache, cu_seqlens_q,
    seq_lens, block tables), `pad` padding query rows, pages in a shuffled order; the caches and
    queries drawn on `device` (the GPU tests' large contexts)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, contexts)]
    blocks = [-(-s // page) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 3, generator=g) + 1
    tables = torch.zeros(len(q_lens), max(blocks) + 1, dtype=torch.int32)
    i = 0
    for r, nb in enumerate(blocks):
        tables[r, :nb] = perm[i:i + nb]
        i += nb
    num_blocks = int(perm.max()) + 1
    gd = g if torch.device(device).type == "cpu" else torch.Generator(device=device).manual_seed(seed)
    kc = quantize_kv(torch.randn(num_blocks, page, kv_heads, d, generator=gd, device=device) * 3, FP8, scales[0])
    vc = quantize_kv(torch.randn(num_blocks, page, kv_heads, d, generator=gd, device=device), FP8, scales[1])
    q = torch.randn(sum(q_lens) + pad, heads, d, generator=gd, device=device).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, kc, vc, *(t.to(device) for t in (cu, torch.tensor(seq_lens, dtype=torch.int32), tables))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (8, 1)])
def test_paged_attention_reads_the_fp8_cache_as_the_reference(dtype, heads, kv_heads):
    # decode rows, a fresh prefill and a chunk after a cached context, padding rows
    q, kc, vc, cu, seq_lens, tables = kv_batch([1, 20, 7, 1], [40, 0, 33, 5], heads, kv_heads, 64, 16, dtype)
    out = ops.paged_attention(q, kc, vc, cu, seq_lens, tables, 0.125, 0, True, 0.1, 0.02)
    ref = paged_attention_ref(q, kc, vc, cu, seq_lens, tables, 0.125, 0.1, 0.02)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert (out[int(cu[-1]):] == 0).all()
    # the scales are applied: unscaled codes give another answer
    other = ops.paged_attention(q, kc, vc, cu, seq_lens, tables, 0.125, 0, True, 1.0, 1.0)
    assert not torch.allclose(other.float(), out.float(), atol=1e-2)


def test_fp8_attention_is_close_to_the_model_dtype_cache():
    """What the quantization costs: attention over fp8(K), fp8(V) vs over K, V themselves."""
    g = torch.Generator().manual_seed(1)
    n, heads, kvh, d = 64, 8, 2, 64
    k, v = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
    q = torch.randn(n, heads, d, generator=g)
    slots = torch.arange(16, 16 + n)
    exact = [torch.zeros(6, 16, kvh, d) for _ in range(2)]
    fp8 = [torch.zeros(6, 16, kvh, d, dtype=FP8) for _ in range(2)]
    ops.reshape_and_cache(k, v, *exact, slots)
    ops.reshape_and_cache(k, v, *fp8, slots, 1.0, 1.0)
    cu, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    tables = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int32)
    a = ops.paged_attention(q, *exact, cu, lens, tables, d ** -0.5)
    b = ops.paged_attention(q, *fp8, cu, lens, tables, d ** -0.5, 0, True, 1.0, 1.0)
    err = (a - b).abs()
    assert err.max() < 0.2 and err.mean() < 0.015, (err.max(), err.mean())  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_stores_the_quantized_rotated_key(qk_norm):
    g = torch.Generator().manual_seed(2)
    n, heads, kvh, d = 9, 4, 2, 32
    q, k, v = (torch.randn(n, h, d, generator=g).to(torch.bfloat16) for h in (heads, kvh, kvh))
    positions = torch.arange(n) * 3
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    w = (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16) if qk_norm else None
    kc, vc = torch.zeros(4, 8, kvh, d, dtype=FP8), torch.zeros(4, 8, kvh, d, dtype=FP8)
    slots = torch.arange(8, 8 + n)
    q_rot = ops.rope_and_cache(positions, q, k, v, cos_sin, w, w, 1e-6, kc, vc, slots, 0.25, 0.125)
    if qk_norm:
        k = ops.rms_norm(k, w, 1e-6)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    k_rot = apply_rope(k.reshape(n, -1), cos, sin, d).view(n, kvh, d)
    flat_k, flat_v = kc.view(-1, kvh, d), vc.view(-1, kvh, d)
    assert torch.equal(_codes(flat_k[slots]), _codes(quantize_kv(k_rot, FP8, 0.25)))
    assert torch.equal(_codes(flat_v[slots]), _codes(quantize_kv(v, FP8, 0.125)))
    assert q_rot.dtype == torch.bfloat16  # the query is never quantized


def test_rope_paged_attention_cpu_matches_its_reference():
    g = torch.Generator().manual_seed(3)
    n, heads, kvh, d = 3, 4, 2, 32
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kvh, kvh))
    freqs = torch.outer(torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    caches = [quantize_kv(torch.randn(4, 8, kvh, d, generator=g), FP8, 0.5) for _ in range(2)]
    copies = [c.clone() for c in caches]
    positions = torch.tensor([9, 4, 0])
    slots = torch.tensor([8 + 9, 16 + 4, 24])
    cu = torch.arange(n + 1, dtype=torch.int32)
    lens = (positions + 1).to(torch.int32)
    tables = torch.tensor([[0, 1], [0, 2], [3, 0]], dtype=torch.int32)
    out = ops.rope_paged_attention(positions, q, k, v, cos_sin, *caches, slots, cu, lens, tables, d ** -0.5, 1,
                                   0.5, 0.25)
    ref = rope_paged_attention_ref(positions, q, k, v, cos_sin, *copies, slots, cu, lens, tables, d ** -0.5, 1,
                                   0.5, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(_codes(caches[0]), _codes(copies[0])) and torch.equal(_codes(caches[1]), _codes(copies[1]))


# opcheck's schema test does arithmetic on the mutated tensors, which torch has no fp8 kernels for
# on the CPU: fp8 caches get the other checks, model-dtype caches (with the scale arguments) all.
_FP8_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("cache_dtype", [FP8, torch.float32])
def test_opcheck_with_scales(cache_dtype):
    checks = _FP8_CHECKS if cache_dtype == FP8 else "ALL"
    g = torch.Generator().manual_seed(4)
    n, kvh, d = 5, 2, 64
    key, value = torch.randn(n, kvh, d, generator=g), torch.randn(n, kvh, d, generator=g)
    caches = (torch.zeros(3, 16, kvh, d, dtype=cache_dtype), torch.zeros(3, 16, kvh, d, dtype=cache_dtype))
    slots = torch.tensor([16, 17, -1, 18, 19])
    torch.library.opcheck(torch.ops.compilelm.reshape_and_cache.default, (key, value, *caches, slots, 0.5, 0.25),
                          test_utils=checks)
    q, kc, vc, cu, seq_lens, tables = kv_batch([1, 6], [10, 3], 8, 2, 64, 16, torch.float32)
    if cache_dtype != FP8:
        kc, vc = kc.float(), vc.float()
    torch.library.opcheck(torch.ops.compilelm.paged_attention.default,
                          (q, kc, vc, cu, seq_lens, tables, 0.125, 0, True, 0.1, 0.02), test_utils=checks)
    freqs = torch.outer(torch.arange(32).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    torch.library.opcheck(torch.ops.compilelm.rope_and_cache.default,
                          (torch.arange(n), torch.randn(n, 4, d, generator=g), key, value, cos_sin, None, None, 0.0,
                           *caches, slots, 0.5, 0.25), test_utils=checks)


def test_bad_scales_and_dtypes_are_refused():
    key = torch.randn(2, 2, 64)
    caches = (torch.zeros(2, 16, 2, 64, dtype=FP8), torch.zeros(2, 16, 2, 64, dtype=FP8))
    with pytest.raises(RuntimeError, match="k_scale must be finite and > 0"):
        ops.reshape_and_cache(key, key, *caches, torch.tensor([16, 17]), 0.0, 1.0)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):  # an fp8 source: never
        ops.reshape_and_cache(key.to(FP8), key.to(FP8), *caches, torch.tensor([16, 17]))
    mixed = (caches[0], torch.zeros(2, 16, 2, 64))
    with pytest.raises(RuntimeError, match="same shape"):
        ops.paged_attention(torch.randn(1, 2, 64), *mixed, torch.tensor([0, 1], dtype=torch.int32),
                            torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 1.0)


# -- config, flag, memory -------------------------------------------------------------------------

def test_cache_config_validates_kv_cache_dtype():
    assert CacheConfig().torch_cache_dtype(torch.bfloat16) == torch.bfloat16
    for name in ("fp8", "fp8_e4m3"):
        cfg = CacheConfig(kv_cache_dtype=name)
        assert cfg.fp8 and cfg.torch_cache_dtype(torch.bfloat16) == FP8_KV_DTYPE
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("dummy:tiny", kv_cache_dtype="bf16")


def test_flag_reaches_the_config_and_names_itself():
    from compilelm.entrypoints.engine_args import ArgError, add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "fp8"])).cache.kv_cache_dtype == "fp8"
    assert engine_config_from_args(parser.parse_args([])).cache.kv_cache_dtype == "auto"
    with pytest.raises(ArgError, match="^--kv-cache-dtype: kv_cache_dtype fp8_e5m2 is not supported"):
        engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


def test_kv_block_bytes_and_cache_key():
    from compilelm.config import EngineConfig
    from compilelm.models.config import dummy_config
    from compilelm.runtime.memory import kv_bytes_per_block
    mc = dummy_config("llama-3.1-8b")
    assert kv_bytes_per_block(mc, 16, FP8) * 2 == kv_bytes_per_block(mc, 16, torch.bfloat16)
    assert kv_bytes_per_block(mc, 16, FP8) == 16 * 32 * 2 * 8 * 128  # 1 byte an element
    # the compiled pieces never see a cache (the attention ops and the QKV graph ops read it from the
    # forward context at run time): fp8 and model-dtype caches share compiled code
    auto = EngineConfig(device="cpu").cache_key_factors(mc)
    assert auto == EngineConfig(device="cpu", cache=CacheConfig(kv_cache_dtype="fp8")).cache_key_factors(mc)


# -- the engine ------------------------------------------------------------------------------------

TINY = dict(model_overrides={"num_hidden_layers": 2}, max_model_len=256, kv_cache_memory_gb=0.01,
            enforce_eager=True, device="cpu")
PROMPTS = [[5, 6, 7], list(range(100, 140)), [9] * 17, list(range(1000, 1003)), list(range(300, 420, 3))]


def _greedy(kv_cache_dtype):
    llm = LLM("dummy:smollm2-135m", kv_cache_dtype=kv_cache_dtype, **TINY)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_engine_fp8_kv_greedy_agrees_with_the_model_dtype_cache(caplog):
    caplog.set_level(logging.INFO, logger="compilelm")
    auto, llm_a = _greedy("auto")
    runner = llm_a.engine.model_runner
    assert next(iter(runner.kv_caches.values()))[0].dtype == torch.float32 and runner.kv_scales == {}
    caplog.clear()
    fp8, llm_f = _greedy("fp8")
    runner = llm_f.engine.model_runner
    assert next(iter(runner.kv_caches.values()))[0].dtype == FP8
    assert set(runner.kv_scales.values()) == {(1.0, 1.0)}  # no checkpoint scales: vLLM's default
    assert "KV cache (float8_e4m3fn)" in caplog.text and "no k/v scales" in caplog.text
    # the same memory holds 4x the fp32 cache's blocks (2x a bf16 cache's)
    assert llm_f.engine.model_runner.num_blocks >= 4 * llm_a.engine.model_runner.num_blocks
    same = sum(a == b for x, y in zip(auto, fp8) for a, b in zip(x, y))
    total = sum(len(x) for x in auto)
    assert same / total >= 0.75, (same, total, auto, fp8)  # high, not required equal


def test_qkv_graph_ops_write_fp8_caches_through_rope_and_cache():
    """The QKV + RoPE graph ops (passes.fuse_qkv_rope / fuse_norm_gemm) with an fp8 next cache:
    the projection, then rope_and_cache with that layer's scales, the same as unfused."""
    from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context
    g = torch.Generator().manual_seed(7)
    m, hidden, heads, kvh, d = 3, 64, 4, 2, 16
    x, res = torch.randn(m, hidden, generator=g), torch.randn(m, hidden, generator=g)
    w = torch.randn((heads + 2 * kvh) * d, hidden, generator=g) * 0.1
    nw = torch.rand(hidden, generator=g) + 0.5
    positions = torch.arange(m) + 2
    freqs = torch.outer(torch.arange(16).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    slots = torch.arange(8, 8 + m)
    cases = {
        "qkv_rope": (lambda: torch.ops.compilelm.qkv_rope(x, w, positions, cos_sin, heads), ops.linear(x, w)),
        "rms_norm_qkv_rope": (lambda: torch.ops.compilelm.rms_norm_qkv_rope(x, nw, 1e-6, w, positions, cos_sin, heads),
                              ops.rms_norm_linear(x, nw, 1e-6, w)),
        "fused_add_rms_norm_qkv_rope": (
            lambda: torch.ops.compilelm.fused_add_rms_norm_qkv_rope(x, res, nw, 1e-6, w, positions, cos_sin, heads)[0],
            ops.fused_add_rms_norm_linear(x, res, nw, 1e-6, w)[0]),
    }
    for name, (run, qkv) in cases.items():
        caches = (torch.zeros(3, 8, kvh, d, dtype=FP8), torch.zeros(3, 8, kvh, d, dtype=FP8))
        meta = AttentionMetadata(slots, None, None, None, 1, 1)
        with set_forward_context(ForwardContext(meta, {"a": caches, "b": caches}, {"a": (0.5, 0.25)})):
            q = run()
        ref = tuple(torch.zeros_like(c) for c in caches)
        qq, kk, vv = (t.view(m, -1, d) for t in qkv.split([heads * d, kvh * d, kvh * d], dim=-1))
        q_ref = ops.rope_and_cache(positions, qq, kk, vv, cos_sin, None, None, 0.0, *ref, slots, 0.5, 0.25)
        torch.testing.assert_close(q, q_ref.view(m, -1), msg=name)
        assert all(torch.equal(_codes(a), _codes(b)) for a, b in zip(caches, ref)), name
