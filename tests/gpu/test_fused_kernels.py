"""CUDA kernels of the fused ops (csrc/cuda: norm_quant_kernels.cu, quant_kernels.cu,
rope_cache_kernels.cu) against the plain-torch references on the GPU, opcheck, CUDA-graph
capture/replay, and the fp8 model compiled with the fusion passes on vs off.

FP8 tolerance: the kernels round to the activation dtype where the references do
(T(weight * T(x * inv_rms)), T(T(silu(gate)) * up)), so an fp8 code can differ only where the
order of a row reduction (the sum of squares) moves a value across a rounding boundary: at most
one fp8 step (adjacent codes), and at most 0.1% of the elements. A dynamic scale may differ by
one rounding step of the activation dtype (its amax element can), so the codes are compared with
the reference values quantized with the kernel's own scale, and the scales with that tolerance.

Run as a script (`python -m tests.gpu.test_fused_kernels OUT.json [--tokens 1 64 2048 16384]
[--inductor-from 64]`) for the timing table: each fused kernel vs its unfused eager torch
composition, and vs that composition compiled by Inductor (what the graph runs with the pass off).
"""

import argparse
import gc
import glob
import json
import os
import statistics

import pytest
import torch

from compilelm import LLM, SamplingParams
from compilelm.ops import fused_add_rms_norm_ref, rope_and_cache_ref
from compilelm.ops import quant as q_ops
from compilelm.ops.activation import silu_and_mul
from compilelm.ops.norm import rms_norm
from tests.test_fused_ops import quant_cases, rope_inputs

pytestmark = pytest.mark.gpu

OPS = torch.ops.compilelm
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # relative step of 1 ulp
# 99: odd rows, the scalar (unvectorized) path; 20480: rows over 1024 threads' worth of vectors and
# past the register-row kernels (2048 vectors); 14336: Llama-3.1-8B's MLP; dynamic quant on sm_90+
# takes a cluster a row below two rows an SM, one block a row past what a cluster holds (72000) and
# at prefill's row counts (300: the row in registers, 1 / 2 / 4 vectors a thread by dtype and width,
# or past 8192 16-bit columns one block of 256 threads a row)
SHAPES = [(1, 4096), (33, 64), (7, 99), (3, 20480), (1, 14336), (2, 72000), (300, 99), (300, 4096), (300, 14336)]


def cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def fp8_codes(q):
    """fp8 values as ordered integers: adjacent values differ by 1 (sign-magnitude -> signed)."""
    bits = q.view(torch.uint8).to(torch.int16)
    magnitude = bits & 0x7F
    return torch.where(bits >= 128, -magnitude, magnitude)


def assert_fp8_close(q, want):
    assert q.dtype == want.dtype == torch.float8_e4m3fn and q.shape == want.shape
    steps = (fp8_codes(q) - fp8_codes(want)).abs()
    assert steps.max().item() <= 1, f"fp8 codes {steps.max().item()} steps apart"
    assert (steps > 0).float().mean().item() <= 1e-3, f"{(steps > 0).float().mean().item():.2%} of fp8 codes differ"


def check_quantized(q, scale, y, static_scale):
    """q, scale (kernel) against y (the reference's value before quantization)."""
    if static_scale is not None:
        assert torch.equal(scale, static_scale) and scale.data_ptr() != static_scale.data_ptr()
        assert_fp8_close(q, q_ops.quant_fp8_static_ref(y, static_scale))
        return
    _, want_scale = q_ops.quant_fp8_per_token_ref(y)
    assert scale.shape == want_scale.shape and scale.dtype == torch.float32
    # fp32: y = T(w * T(x * inv_rms)) may move by a few ulps with inv_rms, and amax / 448 rounds again
    rtol = 1e-6 if y.dtype == torch.float32 else STEP[y.dtype] * 1.01
    torch.testing.assert_close(scale, want_scale, rtol=rtol, atol=0)
    assert_fp8_close(q, q_ops.quant_fp8_static_ref(y, scale))


def rows(num_tokens, hidden, dtype, seed, strided=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden + (8 if strided else 0), device="cuda", generator=g) * 2
    return x.to(dtype)[:, :hidden]


def norm_weight(hidden, dtype):
    return (torch.rand(hidden, device="cuda") + 0.5).to(dtype)


STATIC_SCALE = torch.tensor([0.02])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_quant(dtype, shape, static):
    x = rows(*shape, dtype, seed=1, strided=True)
    if static:
        scale = STATIC_SCALE.cuda()
        check_quantized(q_ops.quant_fp8_static(x, scale), scale.clone(), x, scale)
    else:
        check_quantized(*q_ops.quant_fp8_per_token(x), x, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_rms_norm_quant(dtype, shape, static):
    x, w = rows(*shape, dtype, seed=2, strided=True), norm_weight(shape[1], dtype)
    scale = STATIC_SCALE.cuda() if static else None
    q, s = q_ops.rms_norm_quant_fp8(x, w, 1e-6, scale)
    check_quantized(q, s, rms_norm(x, w, 1e-6), scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_fused_add_rms_norm_quant(dtype, shape, static):
    x, res, w = rows(*shape, dtype, seed=3), rows(*shape, dtype, seed=4, strided=True), norm_weight(shape[1], dtype)
    scale = STATIC_SCALE.cuda() if static else None
    q, s, residual = q_ops.fused_add_rms_norm_quant_fp8(x, res, w, 1e-6, scale)
    assert torch.equal(residual, x + res)
    check_quantized(q, s, rms_norm(x + res, w, 1e-6), scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("static", [False, True])
def test_silu_mul_quant(dtype, shape, static):
    x = rows(shape[0], 2 * shape[1], dtype, seed=5)
    scale = STATIC_SCALE.cuda() if static else None
    q, s = q_ops.silu_mul_quant_fp8(x, scale)
    assert q.shape == (shape[0], shape[1])
    check_quantized(q, s, silu_and_mul(x), scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(dtype, shape):
    # same roundings as the reference; the sum of squares' order can move T(x * inv_rms) by one
    # step, which the rounding of weight * it can carry to two; in fp32 that moves most elements
    # by an ulp or so (the tolerance bounds them), in 16-bit types a few
    x, res, w = rows(*shape, dtype, seed=6, strided=True), rows(*shape, dtype, seed=7), norm_weight(shape[1], dtype)
    out, residual = OPS.fused_add_rms_norm(x, res, w, 1e-6)
    want, want_residual = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(residual, want_residual)
    torch.testing.assert_close(out, want, rtol=2 * STEP[dtype] if dtype != torch.float32 else 1e-5, atol=1e-6)
    if dtype != torch.float32:
        assert (out != want).float().mean().item() <= 1e-3


def rope_fp32_ref(positions, x, cos_sin, weight, eps):
    """RoPE computed in fp32 and rounded once (the kernel's arithmetic; Inductor's for the
    unfused graph), cos/sin rounded to x's dtype first as apply_rope does."""
    dtype = x.dtype
    if weight is not None:
        x = rms_norm(x, weight, eps)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos = torch.cat([cos, cos], dim=-1).to(dtype).float()[:, None]  # [num_tokens, 1, head_size]
    sin = torch.cat([sin, sin], dim=-1).to(dtype).float()[:, None]
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_rope_and_cache(dtype, head_size, qk_norm, num_tokens):
    args = list(cuda(rope_inputs(dtype, num_tokens, num_heads=8, num_kv_heads=2, head_size=head_size,
                                 qk_norm=qk_norm, seed=head_size + num_tokens)))
    if dtype == torch.bfloat16 and num_tokens == 1:
        args[4] = args[4].to(dtype)  # a cos_sin_cache in the model dtype (model.to(dtype) casts buffers)
    positions, q, k, v, cos_sin, q_w, k_w, eps, key_cache, value_cache, slots = args
    ref_args = args[:8] + [key_cache.clone(), value_cache.clone(), slots]
    out = OPS.rope_and_cache(*args)
    want = rope_and_cache_ref(*ref_args)
    assert out.shape == q.shape and out.is_contiguous()
    # vs the fp32 arithmetic: within a step (two with QK-norm, whose reduction order differs);
    # vs eager's roundings of each product: within two (three)
    steps = 2 if qk_norm else 1
    tol = dict(rtol=max(steps * STEP[dtype], 1e-5), atol=1e-5 if dtype == torch.float32 else 1e-3)
    torch.testing.assert_close(out, rope_fp32_ref(positions, q, cos_sin, q_w, eps), **tol)
    # eager: up to half a step of each product's magnitude (|x| < ~6) twice, plus the sum's rounding
    loose = dict(rtol=max((steps + 1) * STEP[dtype], 1e-5),
                 atol={torch.float32: 1e-5, torch.bfloat16: 0.08, torch.float16: 0.01}[dtype])
    torch.testing.assert_close(out, want, **loose)
    written = slots >= 0
    rows_k = key_cache.view(-1, *k.shape[1:])
    torch.testing.assert_close(rows_k[slots[written]], rope_fp32_ref(positions, k, cos_sin, k_w, eps)[written], **tol)
    torch.testing.assert_close(key_cache, ref_args[8], **loose)  # other rows untouched (equal)
    assert torch.equal(value_cache, ref_args[9])


def all_cases():
    cases = [(op, cuda(args)) for op, args in quant_cases(torch.bfloat16)]
    for qk_norm in (False, True):
        cases.append((OPS.rope_and_cache.default, cuda(rope_inputs(torch.bfloat16, qk_norm=qk_norm))))
    return cases


def test_opcheck():
    for op, args in all_cases():
        torch.library.opcheck(op, args)


def test_cuda_graph_capture_and_replay():
    """Each op captured once, then replayed after new values are written into its input buffers:
    the same outputs (and cache rows) as a direct call on those values."""
    for op, args in all_cases():
        is_rope = op is OPS.rope_and_cache.default
        inputs = [args[i] for i in ((1, 2, 3) if is_rope else (0, 1) if "add" in op.name() else (0,))]
        op(*args)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = op(*args)
        for t in inputs:
            t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
        caches = [args[8].clone(), args[9].clone()] if is_rope else []
        graph.replay()
        replayed_caches = [args[8].clone(), args[9].clone()] if is_rope else []
        for cache, before in zip(args[8:10] if is_rope else [], caches):
            cache.copy_(before)
        direct = op(*args)
        captured = captured if isinstance(captured, (tuple, list)) else [captured]
        direct = direct if isinstance(direct, (tuple, list)) else [direct]
        for a, b in zip(captured, direct):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), op
        for a, b in zip(replayed_caches, args[8:10] if is_rope else []):
            assert torch.equal(a, b), op


def pass_matches(dump_dir):
    matches = {}
    for path in glob.glob(os.path.join(dump_dir, "**", "report.json"), recursive=True):
        with open(path) as f:
            for p in json.load(f)["passes"]:
                matches[p["pass"]] = matches.get(p["pass"], 0) + p["matches"]
    return matches


FUSIONS = ("RMSNormQuantFusionPass", "SiluMulQuantFusionPass", "RopeAttentionFusionPass")


@pytest.mark.parametrize("shape", ["llama3", "qwen3"])
def test_fp8_model_same_tokens_with_and_without_fusions(shape, tmp_path):
    """Compiled + CUDA graphs, fp8 W8A8: the fusion passes on (fused CUDA kernels: norm/act + quant,
    (QK-norm +) RoPE + cache write) and off give the same greedy tokens. Llama-3 and Qwen3 shapes
    with random weights (tests/gpu/test_engine_gpu.py's models), chunked prefills and padded
    decode graphs.

    fp32 activations: there a kernel and the unfused graph differ by fp32 roundings, which almost
    never move an fp8 code. In bf16 they round differently by design: Inductor computes the
    unfused silu(gate) * up in fp32 and rounds once, the fused op rounds silu(gate) to bf16 first
    (as eager torch and the CPU implementation do). A one-step bf16 difference moves ~1/32 of the
    fp8 codes it touches, and these random 4-layer models then pick other greedy tokens: measured
    on CPU too, where the fused ops are the eager compositions themselves. The bf16 kernels are
    checked op by op above.

    A sequence may still part where one fp8 code flips (seen on the Qwen3 shape: the fused QK-norm
    rounds its rsqrt differently from Inductor's; one e4m3 step is 6-12% of an activation, and at
    the parting step the two tokens were 0.18 nats apart): there the two runs' tokens must be in
    each other's top 5 within 0.5 nats, and both runs must agree up to that point. A wrong kernel
    parts every sequence at once, by whole nats."""
    dtype = "float32"
    from tests.gpu.test_engine_gpu import build_hf_model, prompts

    build_hf_model(shape, tmp_path / "model")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    tokens, logprobs, matches = {}, {}, {}
    for fuse in (True, False):
        dump = str(tmp_path / f"dump_{fuse}")
        llm = LLM(str(tmp_path / "model"), dtype=dtype, quantization="fp8", device="cuda", max_model_len=256,
                  max_num_seqs=16, max_num_batched_tokens=64,
                  compilation_config={"use_cache": False, "dump_dir": dump, "cudagraph_capture_sizes": [1, 2, 4, 8],
                                      "passes": {"fuse_norm_quant": fuse, "fuse_act_quant": fuse,
                                                 "fuse_rope_attention": fuse}})
        outs = [o.outputs[0] for o in llm.generate(prompts(), params, use_tqdm=False)]
        tokens[fuse], logprobs[fuse] = [o.token_ids for o in outs], [o.logprobs for o in outs]
        matches[fuse] = pass_matches(dump)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert all(matches[True].get(name, 0) > 0 for name in FUSIONS), matches[True]
    assert not any(matches[False].get(name, 0) for name in FUSIONS), matches[False]
    parted = []  # (sequence, step, the fused run's token and logprob gap to the other's)
    for seq, (fused, plain) in enumerate(zip(tokens[True], tokens[False])):
        i = next((i for i, (a, b) in enumerate(zip(fused, plain)) if a != b), None)
        if i is None:
            continue
        for run, (mine, other) in ((True, (fused[i], plain[i])), (False, (plain[i], fused[i]))):
            top = logprobs[run][seq][i]  # token id -> Logprob, the top 5 and the sampled one
            assert other in top, f"seq {seq} step {i}: {other} is not among the top 5 of the fuse={run} run"
            assert top[mine].logprob - top[other].logprob < 0.5, (seq, i, top[mine], top[other])
        top = logprobs[True][seq][i]
        parted.append((seq, i, round(top[fused[i]].logprob - top[plain[i]].logprob, 3)))
    assert len(parted) <= 1, f"{shape}: {len(parted)} of {len(tokens[True])} parted (seq, step, gap): {parted}"


# -- timing table (script) ---------------------------------------------------------------------

def _median_us(fn, iters=200, warmup=20):
    """Median of per-call CUDA-event times, with L2 flushed before each call (cold inputs)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def _bench_cases(num_tokens, hidden=4096, mlp=14336, dtype=torch.bfloat16):
    """name -> (fused call, the unfused composition, bytes the op must move)."""
    x, res, w = rows(num_tokens, hidden, dtype, 1), rows(num_tokens, hidden, dtype, 2), norm_weight(hidden, dtype)
    gate_up = rows(num_tokens, 2 * hidden, dtype, 3)
    mlp_gate_up = rows(num_tokens, 2 * mlp, dtype, 4)
    s = STATIC_SCALE.cuda()
    rope = cuda(rope_inputs(dtype, num_tokens, num_heads=32, num_kv_heads=8, head_size=128))
    positions, q, k, v, cos_sin, _, _, eps, key_cache, value_cache, slots = rope
    qn_w, kn_w = norm_weight(128, dtype), norm_weight(128, dtype)
    rope_args = [positions, q, k, v, cos_sin, None, None, eps, key_cache, value_cache, slots]
    qk_args = [positions, q, k, v, cos_sin, qn_w, kn_w, eps, key_cache, value_cache, slots]
    e, n = x.element_size(), num_tokens * hidden
    return {
        "quant_fp8_per_token": (lambda: OPS.quant_fp8_per_token(x), lambda: q_ops.quant_fp8_per_token_ref(x),
                                n * (e + 1)),
        "quant_fp8_static": (lambda: OPS.quant_fp8_static(x, s), lambda: q_ops.quant_fp8_static_ref(x, s), n * (e + 1)),
        "rms_norm_quant_fp8 (per token)": (lambda: OPS.rms_norm_quant_fp8(x, w, 1e-6, None),
                                           lambda: q_ops.quant_fp8_per_token_ref(rms_norm(x, w, 1e-6)), n * (e + 1)),
        "rms_norm_quant_fp8 (static)": (lambda: OPS.rms_norm_quant_fp8(x, w, 1e-6, s),
                                        lambda: q_ops.quant_fp8_static_ref(rms_norm(x, w, 1e-6), s), n * (e + 1)),
        "fused_add_rms_norm_quant_fp8 (per token)": (
            lambda: OPS.fused_add_rms_norm_quant_fp8(x, res, w, 1e-6, None),
            lambda: q_ops.quant_fp8_per_token_ref(rms_norm(x + res, w, 1e-6)), n * (3 * e + 1)),
        "fused_add_rms_norm": (lambda: OPS.fused_add_rms_norm(x, res, w, 1e-6),
                               lambda: fused_add_rms_norm_ref(x, res, w, 1e-6), n * 4 * e),
        "silu_mul_quant_fp8 (per token)": (lambda: OPS.silu_mul_quant_fp8(gate_up, None),
                                           lambda: q_ops.quant_fp8_per_token_ref(silu_and_mul(gate_up)),
                                           n * (2 * e + 1)),
        f"silu_mul_quant_fp8 (per token, {mlp})": (
            lambda: OPS.silu_mul_quant_fp8(mlp_gate_up, None),
            lambda: q_ops.quant_fp8_per_token_ref(silu_and_mul(mlp_gate_up)), num_tokens * mlp * (2 * e + 1)),
        "rope_and_cache (32/8 heads x 128)": (lambda: OPS.rope_and_cache(*rope_args),
                                              lambda: rope_and_cache_ref(*rope_args), None),
        "rope_and_cache + qk-norm": (lambda: OPS.rope_and_cache(*qk_args), lambda: rope_and_cache_ref(*qk_args), None),
    }


def main(out_path, token_counts=(1, 4096), inductor_from=None):
    """The table: each fused kernel vs its eager torch composition, and (at token counts >=
    inductor_from) vs that composition compiled by Inductor, which is what the graph runs with the
    fusion pass off."""
    results = []
    for num_tokens in token_counts:
        for name, (fused, unfused, nbytes) in _bench_cases(num_tokens).items():
            f, u = _median_us(fused), _median_us(unfused)
            row = {"op": name, "num_tokens": num_tokens, "hidden": 4096, "dtype": "bfloat16",
                   "fused_us": round(f, 2), "unfused_torch_us": round(u, 2), "speedup": round(u / f, 2)}
            if nbytes:
                row["fused_tb_s"] = round(nbytes / (f * 1e-6) / 1e12, 2)
            line = f"{name:42s} {num_tokens:6d} tokens  fused {f:9.2f} us  unfused torch {u:9.2f} us  x{u / f:5.2f}"
            if inductor_from is not None and num_tokens >= inductor_from and nbytes:
                torch._dynamo.reset()
                ind = _median_us(torch.compile(unfused, dynamic=False))
                row["inductor_us"], row["vs_inductor"] = round(ind, 2), round(ind / f, 2)
                line += f"  inductor {ind:9.2f} us  x{ind / f:5.2f}"
            results.append(row)
            print(line, flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    data = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("COMMIT", ""),
            "method": "CUDA events per call, median of 200 after 20 warm-up, L2 flushed before each call; "
                      "unfused = the eager torch composition (the ops' *_ref functions); inductor = that "
                      "composition under torch.compile (dynamic=False); fused_tb_s = the bytes the op must "
                      "read and write over the fused time",
            "results": results}
    with open(out_path, "w") as f:
        json.dump(data, f, indent=2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4096])
    ap.add_argument("--inductor-from", type=int, default=None, help="token counts that also get an Inductor column")
    a = ap.parse_args()
    main(a.out, a.tokens, a.inductor_from)
