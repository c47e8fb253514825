"""The FP8 W8A8 GEMM on the GPU (compilelm/ops/fp8_gemm.py): fp8_stream_mm (1-16 rows), the
Triton kernel (1-64 rows, sm_90) and the routed fp8_linear (every row count) against the
reference, ragged N and K, bias, per-tensor scales, bf16/fp16/fp32 out; the route at each row
count; fp8_linear replayed in a CUDA graph; and the engine: an FP8 model compiled with CUDA graphs
gives eager's greedy tokens."""

import gc

import pytest
import torch

import compilelm.ops  # noqa: F401
from compilelm.ops import fp8_gemm
from compilelm.ops.fp8_gemm import fp8_linear_ref, fp8_mm_triton, fp8_tile_config, route
from compilelm.ops.quant import quant_fp8_per_token_ref

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
ROWS = (1, 2, 3, 4, 8, 16, 64, 65, 256)
# (N, K): ragged N, K not a multiple of 128; on an H100/H200 the stream kernel takes 8 warps a block
# up to ~264 blocks of 16 weight rows (N <= ~4224), 4 above
SHAPES = ((4096, 4096), (1000, 208), (333, 1040), (6144, 4096), (4096, 14336))


def sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def problem(m, n, k, seed=0, bias=False, per_tensor=False, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * torch.linspace(0.5, 4, m, device="cuda")[:, None]
    q, xs = quant_fp8_per_token_ref(x)
    if per_tensor:
        xs = torch.tensor([0.02], device="cuda")
    w = (torch.randn(n, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(FP8)
    ws = (torch.rand(1, n, device="cuda", generator=g) * 0.01 + 1e-3 if not per_tensor
          else torch.tensor([3e-3], device="cuda"))
    b = torch.randn(n, device="cuda", generator=g).to(dtype) if bias else None
    return q, xs, w, ws, b


def check(got, q, xs, w, ws, b, out_dtype):
    want = fp8_linear_ref(q, xs, w, ws, b, torch.float32)
    assert got.dtype == out_dtype and got.shape == want.shape
    # fp32 sums in another order (and the tensor cores' partial sums): 1e-3 of the largest output,
    # plus the output dtype's rounding
    tol = 1e-3 * want.abs().max().item()
    rtol = 0 if out_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=tol)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [r for r in ROWS if r <= 16])
def test_stream_kernel(m, n, k):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8_stream_mm needs sm_89+")
    q, xs, w, ws, b = problem(m, n, k, bias=m % 2 == 1)
    got = torch.ops.compilelm.fp8_stream_mm(q, xs, w, ws, b, torch.bfloat16)
    check(got, q, xs, w, ws, b, torch.bfloat16)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [r for r in ROWS if r <= 64])
def test_triton_kernel(m, n, k):
    if not sm90():
        pytest.skip("the Triton FP8 GEMM is Hopper's (TMA + wgmma)")
    q, xs, w, ws, b = problem(m, n, k, bias=m % 2 == 1)
    for pdl in (False, True):
        check(fp8_mm_triton(q, xs, w, ws, b, torch.bfloat16, pdl=pdl), q, xs, w, ws, b, torch.bfloat16)
    split3 = (*fp8_tile_config(m, n, k)[:4], 3)  # K in 3 slices, whatever the default splits
    check(fp8_mm_triton(q, xs, w, ws, b, torch.bfloat16, config=split3), q, xs, w, ws, b, torch.bfloat16)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("m", ROWS)
def test_routed_op(m, per_tensor, out_dtype):
    n, k = 1008, 1040  # N: ragged for the kernels' tiles, a multiple of 16 for _scaled_mm (m > 64)
    q, xs, w, ws, b = problem(m, n, k, bias=True, per_tensor=per_tensor, dtype=out_dtype)
    check(torch.ops.compilelm.fp8_linear(q, xs, w, ws, b, out_dtype), q, xs, w, ws, b, out_dtype)


@pytest.mark.parametrize("n", [1000, 8192])  # the stream kernel's 8-warp and 4-warp blocks
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 64])
def test_quant_prologue(m, x_dtype, n):
    """fp8_quant_linear (o_proj after fuse_quant_linear): at <= 8 rows fp8_stream_mm quantizes x in
    its prologue, bit for bit what the quant kernel then fp8_stream_mm compute; else the two ops."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8_stream_mm needs sm_89+")
    k = 4096
    g = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn(m, k, device="cuda", generator=g) * torch.logspace(-2, 1, m, device="cuda")[:, None]).to(x_dtype)
    _, _, w, ws, b = problem(m, n, k, bias=True)
    q, xs = torch.ops.compilelm.quant_fp8_per_token(x)
    fused = torch.ops.compilelm.fp8_quant_linear(x, w, ws, b, torch.bfloat16)
    unfused = torch.ops.compilelm.fp8_linear(q, xs, w, ws, b, torch.bfloat16)
    assert torch.equal(fused, unfused)
    check(fused, q, xs, w, ws, b, torch.bfloat16)
    if m <= 8:
        direct = torch.ops.compilelm.fp8_stream_mm(x, None, w, ws, b, torch.bfloat16)
        assert torch.equal(direct, torch.ops.compilelm.fp8_stream_mm(q, xs, w, ws, b, torch.bfloat16))


@pytest.mark.parametrize("m,k", [(6, 8192), (8, 6144), (7, 8192)])
def test_quant_prologue_at_its_shared_memory_limit(m, k):
    """M x K = 48 KiB of quantized rows (6 x 8192, 8 x 6144) beside the kernel's static shared
    arrays: past the default 48 KiB a block gets, so the launch must raise the kernel's limit;
    7 x 8192 is past the prologue's limit and runs the two ops."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8_stream_mm needs sm_89+")
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    _, _, w, ws, _ = problem(m, 512, k)
    q, xs = torch.ops.compilelm.quant_fp8_per_token(x)
    fused = torch.ops.compilelm.fp8_quant_linear(x, w, ws, None, torch.bfloat16)
    assert torch.equal(fused, torch.ops.compilelm.fp8_linear(q, xs, w, ws, None, torch.bfloat16))
    check(fused, q, xs, w, ws, None, torch.bfloat16)
    if m * k <= fp8_gemm.QUANT_MAX_ELEMENTS:
        assert torch.equal(torch.ops.compilelm.fp8_stream_mm(x, None, w, ws, None, torch.bfloat16), fused)
    else:
        with pytest.raises(RuntimeError, match="quantizing x in the kernel"):
            torch.ops.compilelm.fp8_stream_mm(x, None, w, ws, None, torch.bfloat16)


def test_odd_k_and_strided_rows_fall_back():
    q, xs, w, ws, _ = problem(3, 64, 200)  # K = 200: no kernel (nor cuBLASLt) takes it
    check(torch.ops.compilelm.fp8_linear(q, xs, w, ws, None, torch.bfloat16), q, xs, w, ws, None, torch.bfloat16)
    for out_dtype in (torch.bfloat16, torch.float32):  # N = 1000 past 64 rows: _scaled_mm refuses it
        q, xs, w, ws, b = problem(70, 1000, 256, bias=True, dtype=out_dtype)
        check(torch.ops.compilelm.fp8_linear(q, xs, w, ws, b, out_dtype), q, xs, w, ws, b, out_dtype)
    q, xs, w, ws, _ = problem(2, 64, 272)
    qs = q[:, 16:]  # rows 16-byte aligned, but strided: the kernels take it
    check(torch.ops.compilelm.fp8_linear(qs, xs, w[:, 16:].contiguous(), ws, None, torch.bfloat16),
          qs, xs, w[:, 16:].contiguous(), ws, None, torch.bfloat16)


def test_stream_kernel_refuses_bad_inputs():
    q, xs, w, ws, _ = problem(17, 64, 64)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        torch.ops.compilelm.fp8_stream_mm(q, xs, w, ws, None, torch.bfloat16)
    q, xs, w, ws, _ = problem(2, 64, 200)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.compilelm.fp8_stream_mm(q, xs, w, ws, None, torch.bfloat16)
    _, _, w, ws, _ = problem(9, 64, 64)
    with pytest.raises(RuntimeError, match="quantizing x in the kernel"):
        torch.ops.compilelm.fp8_stream_mm(torch.randn(9, 64, device="cuda"), None, w, ws, None, torch.bfloat16)


def test_route_by_rows():
    dev = torch.device("cuda", torch.cuda.current_device())
    assert route(1, dev) == "stream" and route(8, dev) == "stream"
    assert route(9, dev) == route(16, dev) == ("triton" if sm90() else "stream")  # (faster there at 16)
    assert route(17, dev) == ("triton" if sm90() else "scaled_mm")
    assert route(64, dev) == ("triton" if sm90() else "scaled_mm") and route(65, dev) == "scaled_mm"
    prev = fp8_gemm.set_fp8_routes(0, 0)
    try:
        assert route(1, dev) == "scaled_mm"
    finally:
        fp8_gemm.set_fp8_routes(*prev)


@pytest.mark.parametrize("m", [1, 4, 32])
def test_cuda_graph_replay(m):
    """fp8_linear captured in a CUDA graph replays with new activations and scales in its buffers."""
    q, xs, w, ws, _ = problem(m, 2048, 1024)
    static_q, static_xs = q.clone(), xs.clone()
    torch.ops.compilelm.fp8_linear(static_q, static_xs, w, ws, None, torch.bfloat16)  # warm-up (Triton compile)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.compilelm.fp8_linear(static_q, static_xs, w, ws, None, torch.bfloat16)
    q2, xs2, *_ = problem(m, 2048, 1024, seed=5)
    static_q.copy_(q2)
    static_xs.copy_(xs2)
    graph.replay()
    torch.cuda.synchronize()
    check(out, q2, xs2, w, ws, None, torch.bfloat16)


def test_engine_fp8_graphs_match_eager(tmp_path):
    """A small Llama-3 shaped model (tests/gpu/test_engine_gpu.py's), fp32 activations, fp8
    weights: compiled + CUDA graphs (the fused quant producers feeding fp8_linear, each captured
    size on its kernel) give eager's greedy tokens up to a near-tie (tests/near_ties.py: the fused
    producers round in fp32 otherwise than eager, and the next fp8 quant can make it one code)."""
    from compilelm import LLM, SamplingParams
    from tests.gpu.test_engine_gpu import build_hf_model, prompts
    from tests.near_ties import assert_parts_only_at_near_ties

    build_hf_model("llama3", tmp_path / "model")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = {}
    for eager in (False, True):
        llm = LLM(model=str(tmp_path / "model"), dtype="float32", device="cuda", quantization="fp8",
                  max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, enforce_eager=eager)
        out[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
        if not eager:
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print("parted (prompt, token, margin):", assert_parts_only_at_near_ties(llm, prompts(), out[False], out[True]))
