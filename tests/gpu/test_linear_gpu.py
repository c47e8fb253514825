"""compilelm::linear's CUDA kernel (csrc/cuda/skinny_mm.cu) against fp64 matmuls: M = 1..4
rows (1-2 on the kernel, 3-4 on cuBLAS) in every dtype and on the model shapes (K = 576, 4096,
14336; odd N), the at::mm fallback (M > 2, unaligned or strided inputs), opcheck, CUDA-graph
capture; and RouteLinearPass inside Inductor on a decode-shaped piece (the rewritten graph calls the
op and matches eager); linear_out writes exactly linear's result into a given buffer (the
full graphs' LM head), and linear_argmax_out the argmax of those logits too (ties, NaN, repeated
calls, graph replays). The same for the norm variants (rms_norm_linear,
fused_add_rms_norm_linear: against the reference norm's output in fp64, residual_out exact)
and RMSNormLinearFusionPass inside Inductor; their rope variants (the QKV projection with
rope_and_cache in its epilogue) bit for bit against the projection followed by rope_and_cache."""

import pytest
import torch
from torch.library import opcheck

from compilelm.ops import argmax_rows, linear, linear_argmax_out, linear_out
from compilelm.passes.utility.route_linear import RouteLinearPass

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # of the output's scale


def check(x, w):
    got = linear(x, w)
    want = (x.double() @ w.double().t())
    assert got.dtype == x.dtype and got.shape == want.shape
    scale = want.abs().max().item() + 1e-6
    err = (got.double() - want).abs().max().item() / scale
    assert err <= TOL[x.dtype], f"relative error {err:.2e} for x {tuple(x.shape)} w {tuple(w.shape)} {x.dtype}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(960, 576), (577, 576), (4096, 4096), (333, 14336), (7, 8)])
def test_kernel_matches_reference(dtype, m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m * 1000 + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(dtype)
    check(x, w)


def test_fallbacks_and_views():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(64, 80, device="cuda", generator=g, dtype=torch.bfloat16)
    check(torch.randn(9, 80, device="cuda", generator=g, dtype=torch.bfloat16), w)  # M > 2: cuBLAS
    big = torch.randn(2, 96, device="cuda", generator=g, dtype=torch.bfloat16)
    check(big[:, :80], w)  # row stride 96: still whole 16-byte vectors
    check(big[:, 1:81], w)  # unaligned rows: at::mm
    check(torch.randn(2, 81, device="cuda", generator=g), torch.randn(5, 81, device="cuda", generator=g))  # K % 4
    check(torch.randn(2, 80, device="cuda", generator=g, dtype=torch.bfloat16), w[::2])  # every other row
    with pytest.raises(RuntimeError, match="one dtype"):
        linear(torch.randn(1, 80, device="cuda"), w)


@pytest.mark.parametrize("m", [1, 2, 5])
def test_out_variant_writes_the_same_numbers(m):
    """linear_out(x, w, out) == linear(x, w) bit for bit, at M <= 2 (the kernel) and M = 5
    (cuBLAS), into a row slice of a wider buffer (the logits buffer at a smaller graph size);
    nothing outside the slice is touched; a wrong out is refused."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(4099, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    buffer = torch.full((8, 4099), 7.0, device="cuda", dtype=torch.bfloat16)
    assert linear_out(x, w, buffer[:m]) is not None
    torch.testing.assert_close(buffer[:m], linear(x, w), rtol=0, atol=0)
    assert (buffer[m:] == 7.0).all()
    with pytest.raises(RuntimeError, match="out must be"):
        linear_out(x, w, torch.empty(m, 4099, device="cuda"))  # fp32: not x's dtype
    with pytest.raises(RuntimeError, match="out must be"):
        linear_out(x, w, buffer[:m, :4098])
    opcheck(torch.ops.compilelm.linear_out.default, (x, w, buffer[:m]))

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("n", [7, 4099, 49152, 128256])
def test_argmax_variant_writes_the_logits_and_their_argmax(dtype, m, n):
    """linear_argmax_out(x, w, out, ids): out == linear(x, w) bit for bit, ids == the argmax
    of out's rows (argmax_rows and torch agree), at M <= 2 (one kernel: a wave of blocks walking the
    columns, at 128256 many columns per warp) and M = 5 (cuBLAS + argmax_rows); repeated calls on
    new values stay right (the keys and the counter are reset by the last block)."""
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    w = torch.randn(n, 576, device="cuda", generator=g).to(dtype)
    buffer = torch.full((8, n), 7.0, device="cuda", dtype=dtype)
    ids = torch.full((8,), -5, device="cuda", dtype=torch.int64)
    for _ in range(3):
        x = torch.randn(m, 576, device="cuda", generator=g).to(dtype)
        linear_argmax_out(x, w, buffer[:m], ids[:m])
        torch.testing.assert_close(buffer[:m], linear(x, w), rtol=0, atol=0)
        assert ids[:m].tolist() == argmax_rows(buffer[:m]).tolist() == buffer[:m].float().argmax(-1).tolist()
    assert (buffer[m:] == 7.0).all() and (ids[m:] == -5).all()
    opcheck(torch.ops.compilelm.linear_argmax_out.default, (x, w, buffer[:m], ids[:m]))


@pytest.mark.parametrize("m", [1, 2])
def test_argmax_variant_ties_and_nan(m):
    """Equal maxima go to the lowest column, also when the columns are far apart (other blocks,
    other loop steps of a warp); a NaN logit is the maximum (torch.argmax)."""
    g = torch.Generator(device="cuda").manual_seed(m)
    n = 128256
    x = torch.randn(m, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, 576, device="cuda", generator=g, dtype=torch.bfloat16) * 0.01
    best = x[0].float() / x[0].float().norm()  # a row of w far above the others for row 0
    w[n - 3] = (best * 4).to(torch.bfloat16)
    w[70000] = w[n - 3]
    w[5] = w[n - 3]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ids = torch.empty(m, device="cuda", dtype=torch.int64)
    linear_argmax_out(x, w, out, ids)
    assert ids[0].item() == 5 and ids.tolist() == out.float().argmax(-1).tolist()
    w[90000, 0] = float("nan")
    w[100000, 0] = float("nan")
    linear_argmax_out(x, w, out, ids)
    assert ids.tolist() == [90000] * m == out.float().argmax(-1).tolist()


def test_argmax_variant_in_a_cuda_graph_and_bad_args():
    """Captured once and replayed on new inputs, the argmax follows (the counter and keys are
    left zero by every launch); a wrong argmax buffer is refused."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(49152, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(1, 576, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.empty(1, 49152, device="cuda", dtype=torch.bfloat16)
    ids = torch.empty(1, device="cuda", dtype=torch.int64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear_argmax_out(x, w, out, ids)  # warm-up outside capture (allocates the counters)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear_argmax_out(x, w, out, ids)
    for _ in range(4):
        x.copy_(torch.randn(1, 576, device="cuda", generator=g, dtype=torch.bfloat16))
        graph.replay()
        assert ids.tolist() == linear(x, w).float().argmax(-1).tolist()
    with pytest.raises(RuntimeError, match="argmax must be"):
        linear_argmax_out(x, w, out, torch.empty(1, device="cuda", dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out must be"):
        linear_argmax_out(x, w, torch.empty(1, 49152, device="cuda"), ids)



def test_opcheck_and_graph_capture():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(100, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    opcheck(torch.ops.compilelm.linear.default, (x, w))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        linear(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w)
    x.copy_(torch.randn(2, 256, device="cuda", generator=g, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, linear(x, w), rtol=0, atol=0)


def test_pass_inside_inductor_matches_eager(no_tf32):
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(512, 256, bias=False)

        def forward(self, x):  # no residual add: Inductor would fold it into an addmm
            return self.down(torch.relu(self.up(x)))

    model = Layer().cuda()
    p = RouteLinearPass()
    compiled = torch.compile(model, options={"post_grad_custom_post_pass": p, "fx_graph_cache": False})
    with torch.no_grad():
        for m in (3, 4, 7, 2, 1):
            x = torch.randn(m, 256, device="cuda")
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert p.matches == 4  # both linears of the symbolic-size graph, then of M = 1's (Dynamo specializes size 1)


# -- rms_norm_linear / fused_add_rms_norm_linear ------------------------------------------

EPS = 1e-5


def norm_inputs(m, n, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r = (torch.randn(m, k, device="cuda", generator=g).to(dtype) for _ in range(2))
    gamma = (torch.rand(k, device="cuda", generator=g) + 0.5).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(dtype)
    return x, r, gamma, w


def check_norm_mm(x, r, gamma, w):
    """y against fp64 matmuls of the reference norm's output (rms_norm in x's dtype, its
    roundings); residual_out exactly x + r."""
    from compilelm.ops.norm import rms_norm
    ops = torch.ops.compilelm
    for residual in (None, r):
        if residual is None:
            got, h = ops.rms_norm_linear(x, gamma, EPS, w), x
        else:
            got, r_out = ops.fused_add_rms_norm_linear(x, residual, gamma, EPS, w)
            h = x + residual
            assert torch.equal(r_out, h)
        want = rms_norm(h, gamma, EPS).double() @ w.double().t()
        assert got.dtype == x.dtype and got.shape == want.shape
        err = (got.double() - want).abs().max().item() / (want.abs().max().item() + 1e-6)
        assert err <= TOL[x.dtype], (f"relative error {err:.2e}, residual {residual is not None}, "
                                     f"x {tuple(x.shape)} {x.dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("n, k", [(1728, 576), (577, 576), (6144, 4096), (7, 8)])
def test_norm_kernel_matches_reference(dtype, m, n, k):
    check_norm_mm(*norm_inputs(m, n, k, dtype, seed=m * 1000 + n))


def test_norm_fallbacks_opcheck_and_graph_capture():
    x, r, gamma, w = norm_inputs(2, 96, 80, torch.bfloat16, seed=3)
    big = torch.randn(2, 96, device="cuda", dtype=torch.bfloat16)
    check_norm_mm(big[:, 1:81], r, gamma, w[:, :80].contiguous())  # unaligned rows: norm kernel + at::mm
    check_norm_mm(x, r, gamma, w[:, :80].contiguous())
    check_norm_mm(*norm_inputs(1, 8, 16384, torch.float32, seed=4))  # rows over the shared-memory limit
    ops = torch.ops.compilelm
    w = w[:, :80].contiguous()
    opcheck(ops.rms_norm_linear.default, (x, gamma, EPS, w))
    opcheck(ops.fused_add_rms_norm_linear.default, (x, r, gamma, EPS, w))
    with pytest.raises(RuntimeError, match="norm_weight"):
        ops.rms_norm_linear(x, gamma.float(), EPS, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, r_out = ops.fused_add_rms_norm_linear(x, r, gamma, EPS, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want_y, want_r = ops.fused_add_rms_norm_linear(x, r, gamma, EPS, w)
    assert torch.equal(y, want_y) and torch.equal(r_out, want_r)


# -- the rope variants: the QKV projection with rope_and_cache in its epilogue ------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("heads, kv_heads, head_dim, hidden, cos_fp32",
                         [(9, 3, 64, 576, True), (8, 2, 128, 512, False), (4, 4, 256, 256, True)])
@pytest.mark.parametrize("residual", [False, True])
def test_rope_variant_equals_projection_then_rope_and_cache(dtype, m, heads, kv_heads, head_dim, hidden, cos_fp32,
                                                            residual):
    """The same numbers, bit for bit, as the unfused ops (the projection's columns are the same
    dot products; the rotation is rope_and_cache's): the rotated query, the residual and both
    caches; a padding row (slot -1) writes no cache row. M = 3 runs the two ops."""
    if dtype == torch.float32 and not cos_fp32:
        pytest.skip("fp32 activations take an fp32 cos/sin table")
    ops = torch.ops.compilelm
    x, r, gamma, w = norm_inputs(m, (heads + 2 * kv_heads) * head_dim, hidden, dtype, seed=m * 100 + head_dim)
    g = torch.Generator(device="cuda").manual_seed(7)
    cos_sin = torch.randn(64, head_dim, device="cuda", generator=g).to(torch.float32 if cos_fp32 else dtype)
    positions = torch.randint(0, 64, (m,), device="cuda", generator=g)
    slots = torch.randperm(8 * 16, device="cuda", generator=g)[:m]
    slots[-1] = -1 if m > 1 else slots[-1]
    caches = [torch.zeros(8, 16, kv_heads, head_dim, device="cuda", dtype=dtype) for _ in range(4)]
    if residual:
        got, r_out = ops.fused_add_rms_norm_qkv_rope_cache(x, r, gamma, EPS, w, positions, cos_sin, *caches[:2],
                                                           slots, heads)
        qkv, want_r = ops.fused_add_rms_norm_linear(x, r, gamma, EPS, w)
        assert torch.equal(r_out, want_r)
    else:
        got = ops.rms_norm_qkv_rope_cache(x, gamma, EPS, w, positions, cos_sin, *caches[:2], slots, heads)
        qkv = ops.rms_norm_linear(x, gamma, EPS, w)
    q, k, v = (t.view(m, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                             kv_heads * head_dim], dim=-1))
    want = ops.rope_and_cache(positions, q, k, v, cos_sin, None, None, 0.0, *caches[2:], slots)
    assert got.shape == (m, heads, head_dim) and got.is_contiguous() and torch.equal(got, want)
    for c_got, c_want in zip(caches[:2], caches[2:]):
        assert torch.equal(c_got, c_want) and c_want.abs().sum() > 0
        assert torch.count_nonzero(c_got.view(-1, kv_heads * head_dim).abs().sum(-1)) == (m - 1 if m > 1 else 1)


def test_rope_variant_opcheck_graph_capture_and_bad_args():
    ops = torch.ops.compilelm
    x, r, gamma, w = norm_inputs(1, 15 * 64, 576, torch.bfloat16, seed=5)
    cos_sin = torch.randn(64, 64, device="cuda")
    positions, slots = torch.tensor([3], device="cuda"), torch.tensor([17], device="cuda")
    kc, vc = (torch.zeros(4, 16, 3, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    args = (x, r, gamma, EPS, w, positions, cos_sin, kc, vc, slots, 9)
    opcheck(ops.fused_add_rms_norm_qkv_rope_cache.default, args)
    opcheck(ops.rms_norm_qkv_rope_cache.default, (x, gamma, EPS, w, positions, cos_sin, kc, vc, slots, 9))
    with pytest.raises(RuntimeError, match="num_heads"):
        ops.rms_norm_qkv_rope_cache(x, gamma, EPS, w, positions, cos_sin, kc, vc, slots, 8)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, r_out = ops.fused_add_rms_norm_qkv_rope_cache(*args)
    x.copy_(torch.randn_like(x))
    positions.fill_(11)
    slots.fill_(40)
    graph.replay()
    torch.cuda.synchronize()
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    want_q, want_r = ops.fused_add_rms_norm_qkv_rope_cache(x, r, gamma, EPS, w, positions, cos_sin, kc2, vc2, slots, 9)
    assert torch.equal(q, want_q) and torch.equal(r_out, want_r)
    assert torch.equal(kc[2, 8], kc2[2, 8]) and torch.equal(vc[2, 8], vc2[2, 8])  # slot 40 = block 2, row 8


def compile_with_passes(model, name):
    """torch.compile of `model` with compilelm's post-grad passes; returns (compiled, the pass `name`)."""
    from compilelm.passes.config import PassConfig
    from compilelm.passes.manager import PassManager

    manager = PassManager(PassConfig())
    fusion = next(p for p in manager.post_grad if p.name == name)
    return torch.compile(model, options={"post_grad_custom_post_pass": manager, "fx_graph_cache": False}), fusion


def dynamic_rows():
    """Inputs of 3, 4, 7, 2 and 1 rows marked dynamic: the symbolic-size graph, then M = 1's."""
    for m in (3, 4, 7, 2, 1):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)
        yield x


def test_norm_fusion_inside_inductor_matches_eager(no_tf32):
    from compilelm.layers.layernorm import RMSNorm

    class Block(torch.nn.Module):  # input norm + linear, then add + norm + linear: a decoder layer's two
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = RMSNorm(256), RMSNorm(256)
            self.qkv, self.up = torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 512, bias=False)

        def forward(self, x):
            h, residual = self.n2(self.qkv(self.n1(x)), x)
            return self.up(h), residual

    model = Block().cuda().to(torch.bfloat16)
    with torch.no_grad():
        for norm in (model.n1, model.n2):
            norm.weight.uniform_(0.5, 1.5)
    compiled, fusion = compile_with_passes(model, "RMSNormLinearFusionPass")
    with torch.no_grad():
        for x in dynamic_rows():
            for got, want in zip(compiled(x), model(x)):
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert fusion.matches == 4  # both norms of the symbolic-size graph, then of M = 1's


# -- silu_mul_linear ------------------------------------------------------------------------

def check_act_mm(x, w):
    """y against fp64 matmuls of the reference activation (SiluAndMul in x's dtype, its roundings)."""
    from compilelm.layers.activation import SiluAndMul
    got = torch.ops.compilelm.silu_mul_linear(x, w)
    want = SiluAndMul()(x).double() @ w.double().t()
    assert got.dtype == x.dtype and got.shape == want.shape
    err = (got.double() - want).abs().max().item() / (want.abs().max().item() + 1e-6)
    assert err <= TOL[x.dtype], f"relative error {err:.2e}, x {tuple(x.shape)} {x.dtype}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("n, k", [(576, 1536), (577, 1536), (1024, 3072), (7, 8),
                                  (64, 14336)])  # 14336: M = 2 over the shared-memory limit
def test_silu_mul_kernel_matches_reference(dtype, m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m * 1000 + n)
    x = (torch.randn(m, 2 * k, device="cuda", generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).to(dtype)
    check_act_mm(x, w)


def test_silu_mul_fallbacks_opcheck_and_graph_capture():
    ops = torch.ops.compilelm
    x = torch.randn(2, 160, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, 80, device="cuda", dtype=torch.bfloat16) * 0.05
    big = torch.randn(2, 170, device="cuda", dtype=torch.bfloat16)
    check_act_mm(big[:, 1:161], w)  # unaligned rows: SiLU-and-mul + at::mm
    check_act_mm(x, w)
    opcheck(ops.silu_mul_linear.default, (x, w))
    with pytest.raises(RuntimeError, match="gate | up"):
        ops.silu_mul_linear(x, w[:, :40].contiguous())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ops.silu_mul_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ops.silu_mul_linear(x, w))


def test_silu_mul_fusion_inside_inductor_matches_eager(no_tf32):
    from compilelm.layers.activation import SiluAndMul

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = torch.nn.Linear(256, 1024, bias=False)
            self.down = torch.nn.Linear(512, 256, bias=False)
            self.act = SiluAndMul()

        def forward(self, x):
            return self.down(self.act(self.gate_up(x)))

    model = MLP().cuda().to(torch.bfloat16)
    compiled, fusion = compile_with_passes(model, "SiluMulLinearFusionPass")
    with torch.no_grad():
        for x in dynamic_rows():
            torch.testing.assert_close(compiled(x), model(x), rtol=2e-2, atol=2e-2)
    assert fusion.matches == 2  # the symbolic-size graph's down_proj, then M = 1's
