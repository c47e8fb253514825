"""compilelm::hopper_mm_out (compilelm/ops/hopper_gemm.py: Triton, sm_90) against fp64 matmuls on
the model shapes it serves (Llama-3.1-8B's layers, SmolLM2-135M's LM head; N not a multiple of the
tile, K not a multiple of 128), at 3-64 rows, in a row slice of a wider buffer and inside a CUDA
graph; opcheck; and the routing: linear and its norm / SiLU-and-mul variants send 3-64 rows of a
large weight to it (the profiler sees its kernel) and give cuBLAS's numbers to rounding, and
set_hopper_gemm(False) sends them to cuBLAS. The SiLU-and-mul epilogue (gate_up_silu_mul)
against the kernel's own product and eager SiLU-and-mul, in one kernel, and its routing."""

import pytest
import torch
from torch.library import opcheck

from compilelm.ops import fused_add_rms_norm_linear, linear, linear_out, rms_norm_linear
from compilelm.ops.gemm import gate_up_silu_mul, silu_mul_linear
from compilelm.ops.hopper_gemm import triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or triton is None,
                       reason="hopper_mm_out runs on sm_90 with Triton"),
]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # of the output's scale
KERNEL = "_hopper_mm_kernel"


def rel_err(got, x, w):
    want = x.double() @ w.double().t()
    return (got.double() - want).abs().max().item() / (want.abs().max().item() + 1e-6)


def operands(m, n, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + m * 1000 + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(dtype)
    return x, w


def kernels_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [3, 17, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (49152, 576),
                                  (4100, 2048), (30000, 1000)])
def test_matches_reference(dtype, m, n, k):
    x, w = operands(m, n, k, dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    torch.ops.compilelm.hopper_mm_out(x, w, out, True)
    err = rel_err(out, x, w)
    assert err <= TOL[dtype], f"relative error {err:.2e} at M {m}, weight [{n}, {k}], {dtype}"


def test_row_slice_of_a_wider_buffer_and_repeat_calls_are_identical():
    x, w = operands(12, 6144, 4096, torch.bfloat16)
    wide = torch.zeros(12, 6144 + 64, device="cuda", dtype=torch.bfloat16)
    out = wide[:, :6144]
    torch.ops.compilelm.hopper_mm_out(x, w, out, False)
    first = out.clone()
    torch.ops.compilelm.hopper_mm_out(x, w, out, True)
    assert torch.equal(first, out)  # no split-K: the same numbers every call
    assert rel_err(out, x, w) <= TOL[torch.bfloat16]
    assert torch.count_nonzero(wide[:, 6144:]) == 0


def test_inside_a_cuda_graph():
    x, w = operands(40, 28672, 4096, torch.bfloat16)
    out = torch.empty(40, 28672, device="cuda", dtype=torch.bfloat16)
    torch.ops.compilelm.hopper_mm_out(x, w, out, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.compilelm.hopper_mm_out(x, w, out, True)
    for seed in (1, 2):
        x.copy_(operands(40, 28672, 4096, torch.bfloat16, seed)[0])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, x, w) <= TOL[torch.bfloat16]


def test_bad_inputs_raise():
    x, w = operands(65, 4096, 2048, torch.bfloat16)
    with pytest.raises(RuntimeError, match="hopper_mm_out"):
        torch.ops.compilelm.hopper_mm_out(x, w, torch.empty(65, 4096, device="cuda", dtype=torch.bfloat16), True)
    with pytest.raises(RuntimeError, match="hopper_mm_out"):
        torch.ops.compilelm.hopper_mm_out(x[:8], w, torch.empty(8, 4096, device="cuda"), True)  # fp32 out


def test_opcheck():
    x, w = operands(8, 4096, 2048, torch.bfloat16)
    out = torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16)
    opcheck(torch.ops.compilelm.hopper_mm_out.default, (x, w, out, True))


def test_linear_ops_route_large_weights_here():
    """3-64 rows of an 8M-element weight: the Triton kernel (and cuBLAS's numbers to rounding);
    2 rows: linear's own kernel; a small weight or set_hopper_gemm(False): cuBLAS."""
    dtype = torch.bfloat16
    x, w = operands(24, 4096, 4096, dtype)
    norm_w = (torch.rand(4096, device="cuda") + 0.5).to(dtype)
    residual = torch.randn_like(x)
    gate_up = torch.randn(24, 2 * 4096, device="cuda", dtype=dtype)
    out = torch.empty(24, 4096, device="cuda", dtype=dtype)
    calls = {
        "linear": lambda: linear(x, w),
        "linear_out": lambda: linear_out(x, w, out).clone(),
        "rms_norm_linear": lambda: rms_norm_linear(x, norm_w, 1e-6, w),
        "fused_add_rms_norm_linear": lambda: fused_add_rms_norm_linear(x, residual, norm_w, 1e-6, w)[0],
        "silu_mul_linear": lambda: silu_mul_linear(gate_up, w),
    }
    for name, call in calls.items():
        assert KERNEL in " ".join(kernels_run(call)), name
        ours = call()
        previous = torch.ops.compilelm.set_hopper_gemm(False)
        try:
            assert KERNEL not in " ".join(kernels_run(call)), name
            theirs = call()
        finally:
            torch.ops.compilelm.set_hopper_gemm(previous)
        scale = theirs.double().abs().max().item()
        err = (ours.double() - theirs.double()).abs().max().item() / scale
        assert err <= TOL[dtype], f"{name}: {err:.2e} from cuBLAS"
    assert KERNEL not in " ".join(kernels_run(lambda: linear(x[:2], w)))  # linear's kernel
    small = w[:1024, :1024].contiguous()  # 1M elements: cuBLAS
    assert KERNEL not in " ".join(kernels_run(lambda: linear(x[:, :1024].contiguous(), small)))
    assert KERNEL not in " ".join(kernels_run(lambda: linear(torch.cat([x] * 3), w)))  # 72 rows: cuBLAS


def silu_mul_unfused(x, w):
    """The GEMM's own product [M, 2I], then eager's SiLU-and-mul (torch's F.silu(gate) * up)."""
    gate_up = torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=x.dtype)
    torch.ops.compilelm.hopper_mm_out(x, w, gate_up, True)
    return _silu_and_mul(gate_up)


def _silu_and_mul(gate_up):
    from compilelm.layers.activation import SiluAndMul
    return SiluAndMul()(gate_up)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [3, 17, 64])
@pytest.mark.parametrize("i, k", [(14336, 4096), (4160, 2048), (3000, 1024)])
def test_silu_mul_epilogue_matches_unfused(dtype, m, i, k):
    """Llama-3.1-8B's gate_up_proj, a tile-aligned and a ragged intermediate size, against the plain
    kernel's product and eager SiLU-and-mul: the products are the same sums (same k order), the
    epilogue's exp and division are fast-math where torch's are exact, so silu(gate) may round one
    unit apart and the product with up then up to two (fp16 showed it), and almost no element does;
    and against fp64 to the usual tolerance."""
    x, w = operands(m, 2 * i, k, dtype)
    out = torch.full((m, i), float("nan"), device="cuda", dtype=dtype)
    torch.ops.compilelm.hopper_mm_out(x, w, out, True, True)
    want = silu_mul_unfused(x, w)
    diff = (out.float() - want.float()).abs()
    units = 2 * want.float().abs() * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10) + 1e-6
    assert bool((diff <= units).all()), f"{(diff > units).sum().item()} elements off by more than two units"
    assert (diff == 0).float().mean().item() >= 0.99
    y = x.double() @ w.double().t()
    ref = torch.nn.functional.silu(y[:, :i]) * y[:, i:]
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= TOL[dtype], f"relative error {err:.2e}"


def test_gate_up_silu_mul_routes_and_graph_replays():
    """3-64 rows: one kernel, the Triton one; 2 rows and set_hopper_gemm(False): the product and
    the SiLU-and-mul kernel; inside a CUDA graph with new inputs."""
    dtype = torch.bfloat16
    x, w = operands(24, 2 * 14336, 4096, dtype)
    names = kernels_run(lambda: gate_up_silu_mul(x, w))
    assert len(names) == 1 and KERNEL in names[0], names
    ours = gate_up_silu_mul(x, w)
    previous = torch.ops.compilelm.set_hopper_gemm(False)
    try:
        names = kernels_run(lambda: gate_up_silu_mul(x, w))
        theirs = gate_up_silu_mul(x, w)
    finally:
        torch.ops.compilelm.set_hopper_gemm(previous)
    assert len(names) >= 2 and not any(KERNEL in n for n in names), names  # cuBLAS, then SiLU-and-mul
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
    two = gate_up_silu_mul(x[:2], w)
    torch.testing.assert_close(two, _silu_and_mul(x[:2] @ w.t()), rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gate_up_silu_mul(x, w)
    for seed in (1, 2):
        x.copy_(operands(24, 2 * 14336, 4096, dtype, seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, gate_up_silu_mul(x, w))
    with pytest.raises(RuntimeError, match="gate | up"):
        gate_up_silu_mul(x, w[:-1])
    opcheck(torch.ops.compilelm.gate_up_silu_mul.default, (x, w))
