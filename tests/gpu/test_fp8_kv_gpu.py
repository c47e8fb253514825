"""The FP8 KV cache on the GPU: every CUDA / Triton kernel that writes or reads a float8_e4m3fn
cache against the plain-torch reference (compilelm/ops/attention.py, rope.py), and the engine
with --kv-cache-dtype fp8 compiled + CUDA graphs against itself eager."""

import gc

import pytest
import torch

import compilelm.ops as ops
from compilelm.ops import prefill_attention as prefill
from compilelm.ops.attention import paged_attention_ref, reshape_and_cache_ref, rope_paged_attention_ref
from compilelm.ops.rope import dequantize_kv, quantize_kv
from tests.test_fp8_kv_cache import kv_batch

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
DEV = "cuda"


def _codes(t):
    return t.view(torch.uint8)


def _cos_sin(d, n=20000):
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    f = torch.outer(torch.arange(n, device=DEV).float(), inv)
    return torch.cat([f.cos(), f.sin()], dim=-1)


# -- writers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.07, 0.3)])
def test_reshape_and_cache_cuda_matches_the_reference(dtype, scales):
    g = torch.Generator(device=DEV).manual_seed(0)
    n, kvh, d = 300, 8, 128
    key = (torch.randn(n, kvh, d, generator=g, device=DEV) * 5).to(dtype)
    value = torch.randn(n, kvh, d, generator=g, device=DEV).to(dtype)
    key[0, 0, :2] = torch.tensor([1e4, -1e4])  # saturates
    slots = torch.randperm(40 * 16, generator=g, device=DEV)[:n] + 16
    slots[::7] = -1
    caches = [torch.zeros(41, 16, kvh, d, dtype=FP8, device=DEV) for _ in range(4)]
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots, *scales)
    reshape_and_cache_ref(key, value, caches[2], caches[3], slots, *scales)
    assert torch.equal(_codes(caches[0]), _codes(caches[2])) and torch.equal(_codes(caches[1]), _codes(caches[3]))


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_size", [64, 128])
def test_rope_and_cache_cuda_fp8(qk_norm, head_size):
    g = torch.Generator(device=DEV).manual_seed(1)
    n, heads, kvh, d = 70, 16, 4, head_size
    q, k, v = (torch.randn(n, h, d, generator=g, device=DEV).to(torch.bfloat16) for h in (heads, kvh, kvh))
    positions = torch.randint(0, 4000, (n,), generator=g, device=DEV)
    cos_sin = _cos_sin(d)
    w = (torch.rand(d, generator=g, device=DEV) + 0.5).to(torch.bfloat16) if qk_norm else None
    kc, vc = (torch.zeros(10, 16, kvh, d, dtype=FP8, device=DEV) for _ in range(2))
    slots = torch.arange(16, 16 + n, device=DEV)
    slots[5] = -1
    q_rot = ops.rope_and_cache(positions, q, k, v, cos_sin, w, w, 1e-6, kc, vc, slots, 0.5, 0.25)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    q_ref = ops.rope_and_cache_ref(positions, q, k, v, cos_sin, w, w, 1e-6, kr, vr, slots, 0.5, 0.25)
    torch.testing.assert_close(q_rot, q_ref, atol=2e-2, rtol=2e-2)  # (the model-dtype path's tolerance)
    assert torch.equal(_codes(vc), _codes(vr))  # values: the same cast
    # keys: RoPE in fp32 rounded once vs eager's roundings (one bf16 step apart), then quantized
    torch.testing.assert_close(dequantize_kv(kc, 0.5), dequantize_kv(kr, 0.5), atol=0.05, rtol=0.13)
    # ... and exactly the kernel's contract: the (normed) key rotated in fp32 (no FMA), rounded once
    # to bf16, quantized; with QK-norm the kernel's own norm (rsqrtf, its sum order) may move a bf16
    # step in a few elements (~1e-4 of them before quantization)
    normed = ops.rms_norm(k, w, 1e-6) if qk_norm else k
    cos, sin = (t.to(torch.bfloat16).float()[:, None] for t in cos_sin[positions].chunk(2, dim=-1))
    x1, x2 = normed.float().chunk(2, dim=-1)
    once = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(torch.bfloat16)
    want = quantize_kv(once[slots >= 0], FP8, 0.5)
    got = kc.view(-1, kvh, d)[slots[slots >= 0]]
    if qk_norm:
        assert (_codes(got) == _codes(want)).float().mean() > 0.99
    else:
        assert torch.equal(_codes(got), _codes(want))


def test_qkv_graph_op_routes_fp8_caches_to_rope_and_cache():
    """qkv_rope (the fuse_qkv_rope pass's op) with an fp8 next cache: the projection, then
    rope_and_cache with the layer's scales; the kernel op itself refuses an fp8 cache."""
    from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context
    g = torch.Generator(device=DEV).manual_seed(2)
    m, hidden, heads, kvh, d = 5, 512, 8, 2, 64
    x = torch.randn(m, hidden, generator=g, device=DEV).to(torch.bfloat16)
    w = (torch.randn((heads + 2 * kvh) * d, hidden, generator=g, device=DEV) * 0.05).to(torch.bfloat16)
    positions = torch.arange(m, device=DEV) + 7
    cos_sin = _cos_sin(d, 64)
    caches = tuple(torch.zeros(4, 16, kvh, d, dtype=FP8, device=DEV) for _ in range(2))
    slots = torch.arange(16, 16 + m, device=DEV)
    meta = AttentionMetadata(slots, None, None, None, 1, 1)
    with set_forward_context(ForwardContext(meta, {"l0": caches}, {"l0": (0.5, 0.25)})):
        q = torch.ops.compilelm.qkv_rope(x, w, positions, cos_sin, heads)
    ref_caches = tuple(torch.zeros_like(c) for c in caches)
    qkv = ops.linear(x, w)
    qq, kk, vv = (t.view(m, -1, d) for t in qkv.split([heads * d, kvh * d, kvh * d], dim=-1))
    q_ref = ops.rope_and_cache(positions, qq, kk, vv, cos_sin, None, None, 0.0, *ref_caches, slots, 0.5, 0.25)
    assert torch.equal(q, q_ref.view(m, -1))
    assert all(torch.equal(_codes(a), _codes(b)) for a, b in zip(caches, ref_caches))
    with pytest.raises(RuntimeError, match="fp8 KV caches are written by rope_and_cache"):
        ops.qkv_rope_cache(x, w, positions, cos_sin, *caches, slots, heads)


# -- readers ------------------------------------------------------------------------------------

def _batch(*args, dtype=torch.bfloat16, **kw):
    return kv_batch(*args, dtype=dtype, device=DEV, pad=3, **kw)


def _check(out, ref, cu):
    n = int(cu[-1])
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=2e-2, rtol=2e-2)
    assert (out[n:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 4), (32, 8), (16, 2)])  # groups 1, 2, 4, 8 (two programs of 4)
def test_decode_kernel_pure_decode(dtype, head_size, heads, kv_heads, decode_kernel):
    # batch 1 short (clusters), batch 1 long (split-K), batch 16 (no split / split), mixed lengths
    for q_lens, contexts in (([1], [40]), ([1], [6000]), ([1] * 16, [300 * i + 5 for i in range(16)]),
                             ([1] * 4, [5000, 2000, 9, 777])):
        q, kc, vc, cu, seq_lens, tables = _batch(q_lens, contexts, heads, kv_heads, head_size, dtype=dtype)
        ref = paged_attention_ref(q, kc, vc, cu, seq_lens, tables, head_size ** -0.5, 0.1, 0.02)
        for max_query_len in (1, 0):  # declared pure decode (all rows, last split merges) / unknown
            out = ops.paged_attention(q, kc, vc, cu, seq_lens, tables, head_size ** -0.5, max_query_len, True,
                                      0.1, 0.02)
            _check(out, ref, cu)


def test_decode_llama_8b_shape_at_16k(decode_kernel):
    """The benchmark's case: batch 16 at context 16000, 32 query / 8 kv heads of 128, bf16 (outside
    clusters: on tensor cores, widened to fp16 in shared memory, or on CUDA cores)."""
    q, kc, vc, cu, seq_lens, tables = _batch([1] * 16, [16000 - i for i in range(16)], 32, 8, 128)
    ref = paged_attention_ref(q, kc, vc, cu, seq_lens, tables, 128 ** -0.5, 0.1, 0.02)
    for max_query_len in (1, 0):
        _check(ops.paged_attention(q, kc, vc, cu, seq_lens, tables, 128 ** -0.5, max_query_len, True, 0.1, 0.02),
               ref, cu)


@pytest.mark.parametrize("cluster_merge", [True, False])
def test_decode_split_k_merges(cluster_merge):
    previous = torch.ops.compilelm.set_cluster_merge(cluster_merge)
    try:
        q, kc, vc, cu, seq_lens, tables = _batch([1, 1], [3000, 250], 32, 8, 128)
        ref = paged_attention_ref(q, kc, vc, cu, seq_lens, tables, 128 ** -0.5, 0.1, 0.02)
        _check(ops.paged_attention(q, kc, vc, cu, seq_lens, tables, 128 ** -0.5, 1, True, 0.1, 0.02), ref, cu)
    finally:
        torch.ops.compilelm.set_cluster_merge(previous)


def _poison_freed_memory():
    """NaN in freed blocks of both of the caching allocator's pools (large: split for the next
    large allocations; small: 512 blocks of 4 KB): a kernel reading memory it did not write or
    mask out (a workspace, padding) then changes its output from one call to the next."""
    big = torch.full((1 << 24,), float("nan"), device=DEV)
    small = [torch.full((1024,), float("nan"), device=DEV) for _ in range(512)]
    del big, small


@pytest.mark.parametrize("cluster_merge", [True, False])
def test_decode_gives_the_same_bits_every_call(cluster_merge, decode_kernel):
    """The same pure-decode call over an fp8 cache repeated, freed memory NaN-poisoned before each:
    the same bits every time (split merges sum in a fixed order). Clusters (batch 1, short), split-K
    (batch 1, long), a batch the size of tests/gpu/test_engine_gpu.py's last decodes, and batch 16.
    In stop 49 the cuda_cores engine test's greedy partings moved from one run of a build to the next
    while the tensor-core variant's did not."""
    previous = torch.ops.compilelm.set_cluster_merge(cluster_merge)
    try:
        for q_lens, contexts in (([1], [40]), ([1], [6000]), ([1] * 5, [8, 40, 100, 13, 160]),
                                 ([1] * 16, [300 * i + 5 for i in range(16)])):
            q, kc, vc, cu, seq_lens, tables = _batch(q_lens, contexts, 32, 8, 128)
            outs = []
            for _ in range(3):
                _poison_freed_memory()
                outs.append(ops.paged_attention(q, kc, vc, cu, seq_lens, tables, 128 ** -0.5, 1, True, 0.1, 0.02))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), (q_lens, contexts)
    finally:
        torch.ops.compilelm.set_cluster_merge(previous)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (32, 8), (16, 2)])
def test_mixed_batch_with_prior_context(head_size, heads, kv_heads, decode_kernel):
    """Decode rows, a fresh prefill and chunks after a cached context: paged_attention alone
    (prefill rows through the decode kernel), and the engine's split: Triton prefill_attention for
    the prefill rows beside paged_attention(prefill_rows=False)."""
    q, kc, vc, cu, seq_lens, tables = _batch([1, 90, 33, 1, 200], [500, 0, 700, 3, 1200], heads, kv_heads,
                                             head_size)
    scale = head_size ** -0.5
    ref = paged_attention_ref(q, kc, vc, cu, seq_lens, tables, scale, 0.1, 0.02)
    _check(ops.paged_attention(q, kc, vc, cu, seq_lens, tables, scale, 0, True, 0.1, 0.02), ref, cu)
    assert prefill.supported(q, kc)
    out = ops.paged_attention(q, kc, vc, cu, seq_lens, tables, scale, 0, False, 0.1, 0.02)
    prefill.prefill_attention(out, q, kc, vc, cu, seq_lens, tables, scale, k_scale=0.1, v_scale=0.02)
    _check(out, ref, cu)


def test_cache_past_2_31_elements():
    """A layer's fp8 cache of more than 2^31 elements (a small model's on an H200: an fp8 cache
    holds twice a bf16 one's blocks), the batch's pages at its end: the Triton prefill kernel and
    the decode kernel address them with 64-bit offsets."""
    heads, kvh, d, page = 16, 8, 128, 16
    num_blocks = (1 << 31) // (page * kvh * d) + 64  # 2.15 GB a cache
    kc = torch.zeros(num_blocks, page, kvh, d, dtype=FP8, device=DEV)
    vc = torch.zeros_like(kc)
    q_lens, contexts = [1, 70, 1], [300, 200, 40]
    seq_lens = [q + c for q, c in zip(q_lens, contexts)]
    pages = [-(-s // page) for s in seq_lens]
    tables = torch.zeros(len(q_lens), max(pages), dtype=torch.int32, device=DEV)
    last = num_blocks
    for i, n in enumerate(pages):  # each sequence's pages: the cache's last ones, in reverse
        tables[i, :n] = torch.arange(last - 1, last - 1 - n, -1, dtype=torch.int32, device=DEV)
        last -= n
    g = torch.Generator(device=DEV).manual_seed(9)
    used = tables[tables > 0].long()
    kc[used] = quantize_kv(torch.randn(len(used), page, kvh, d, generator=g, device=DEV) * 3, FP8, 0.1)
    vc[used] = quantize_kv(torch.randn(len(used), page, kvh, d, generator=g, device=DEV), FP8, 0.02)
    q = torch.randn(sum(q_lens), heads, d, generator=g, device=DEV).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    ref = paged_attention_ref(q, kc, vc, cu, lens, tables, scale, 0.1, 0.02)
    _check(ops.paged_attention(q, kc, vc, cu, lens, tables, scale, 0, True, 0.1, 0.02), ref, cu)
    out = ops.paged_attention(q, kc, vc, cu, lens, tables, scale, 0, False, 0.1, 0.02)
    prefill.prefill_attention(out, q, kc, vc, cu, lens, tables, scale, k_scale=0.1, v_scale=0.02)
    _check(out, ref, cu)


def test_rope_paged_attention_fp8_decode():
    g = torch.Generator().manual_seed(5)
    n, heads, kvh, d = 4, 32, 8, 128
    q, k, v = (torch.randn(n, h, d, generator=g).to(torch.bfloat16).to(DEV) for h in (heads, kvh, kvh))
    _, kc, vc, cu, seq_lens, tables = _batch([1] * n, [100, 40, 3000, 7], heads, kvh, d)
    positions = (seq_lens - 1).long()
    slots = torch.stack([tables[i, int(positions[i]) // 16].long() * 16 + positions[i] % 16 for i in range(n)])
    copies = (kc.clone(), vc.clone())
    cos_sin = _cos_sin(d)
    out = ops.rope_paged_attention(positions, q, k, v, cos_sin, kc, vc, slots, cu, seq_lens, tables, d ** -0.5, 1,
                                   0.1, 0.02)
    ref = rope_paged_attention_ref(positions, q, k, v, cos_sin, *copies, slots, cu, seq_lens, tables, d ** -0.5, 1,
                                   0.1, 0.02)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(dequantize_kv(kc, 0.1), dequantize_kv(copies[0], 0.1), atol=0.05, rtol=0.13)


def test_fp8_decode_is_close_to_bf16():
    """The quantization's cost at long context: fp8 attention vs bf16 attention over the same K/V."""
    g = torch.Generator().manual_seed(6)
    ctx, heads, kvh, d = 8000, 32, 8, 128
    k = torch.randn(ctx, kvh, d, generator=g).to(torch.bfloat16).to(DEV)
    v = torch.randn(ctx, kvh, d, generator=g).to(torch.bfloat16).to(DEV)
    q = torch.randn(1, heads, d, generator=g).to(torch.bfloat16).to(DEV)
    blocks = ctx // 16
    bf, f8 = ([torch.zeros(blocks + 1, 16, kvh, d, dtype=dt, device=DEV) for _ in range(2)] for dt in
              (torch.bfloat16, FP8))
    slots = torch.arange(16, 16 + ctx, device=DEV)
    ops.reshape_and_cache(k, v, *bf, slots)
    ops.reshape_and_cache(k, v, *f8, slots, 1.0, 1.0)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    tables = torch.arange(1, blocks + 1, dtype=torch.int32, device=DEV)[None]
    a = ops.paged_attention(q, *bf, cu, lens, tables, d ** -0.5, 1)
    b = ops.paged_attention(q, *f8, cu, lens, tables, d ** -0.5, 1, True, 1.0, 1.0)
    # relative to the output (~0.07 at most: a flat softmax over 8000 keys averages them), so that a
    # wrong scale or a dropped split fails (the CPU kernels, the same codes: 4% of the largest output)
    assert (a.float() - b.float()).abs().max() < 0.1 * a.float().abs().max()


# -- the engine ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["llama3", "qwen3", "llama3_wide"])
def test_engine_graphs_equal_eager_with_fp8_kv(shape, tmp_path, no_tf32):
    from tests.gpu.test_engine_gpu import build_hf_model, run_compilelm
    build_hf_model(shape, tmp_path / "model")
    eager, _ = run_compilelm(tmp_path / "model", enforce_eager=True, kv_cache_dtype="fp8")
    graphs, replays = run_compilelm(
        tmp_path / "model", kv_cache_dtype="fp8",
        compilation_config={"cache_dir": str(tmp_path / "cache"), "cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    assert 8 in replays
    assert graphs == eager
    # the reference: the same fp8 cache on the CPU (plain-torch quantize / dequantize). Not an fp32
    # cache: against one, these random models' greedy streams part early with fp8 on either device
    # (11, 36 and 5 of 80 tokens agree on the CPU, the same counts as on an H200)
    cpu, _ = run_compilelm(tmp_path / "model", device="cpu", enforce_eager=True, kv_cache_dtype="fp8")
    same = sum(a == b for x, y in zip(cpu, eager) for a, b in zip(x, y))
    assert same / sum(len(x) for x in cpu) >= 0.9


def test_engine_bf16_fp8_kv_graphs_and_eager_agree(tmp_path, decode_kernel):
    """bf16 (the served dtype: Triton prefill, the fp8 decode kernel, the QKV fallback) compiled +
    graphs vs eager: the same kernels on the same K/V; compiled bf16 rounds otherwise than eager,
    and e4m3's 3 mantissa bits make a last-bit change of a cached value a code (up to 1/16 of it),
    so the streams may part, each only where eager's own decode saw logits within 10% of the
    largest one; eager's decode logprobs follow a prefill of the same tokens at every step
    (tests/near_ties.py; a wrong scale or kernel is off by far more)."""
    from compilelm import LLM, SamplingParams
    from tests.gpu.test_engine_gpu import build_hf_model, prompts
    from tests.near_ties import assert_parts_only_at_decode_near_ties
    build_hf_model("llama3_wide", tmp_path / "model")
    out = {}
    for name, kw in (("graphs", dict(compilation_config={"cache_dir": str(tmp_path / "cache"),
                                                         "cudagraph_capture_sizes": [1, 2, 4, 8]})),
                     ("eager", dict(enforce_eager=True))):
        llm = LLM(model=str(tmp_path / "model"), dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=64, kv_cache_dtype="fp8", **kw)
        assert next(iter(llm.engine.model_runner.kv_caches.values()))[0].dtype == FP8
        # eager's top logprobs: the margins its decode saw (graphs: the in-graph argmax, no logprobs)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                logprobs=20 if name == "eager" else None)
        out[name] = [o.outputs[0] for o in llm.generate(prompts(), params, use_tqdm=False)]
        if name == "graphs":
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print("parted (prompt, token, margin):",
          assert_parts_only_at_decode_near_ties(llm, prompts(), [o.token_ids for o in out["graphs"]],
                                                [o.token_ids for o in out["eager"]],
                                                [o.logprobs for o in out["eager"]], rel=0.1))
