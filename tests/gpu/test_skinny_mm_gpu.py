"""compilelm::skinny_mm's CUDA kernel (csrc/cuda/skinny_mm.cu) against fp64 matmuls: M = 1..4
rows (1-2 on the kernel, 3-4 on cuBLAS) in every dtype and on the model shapes (K = 576, 4096,
14336; odd N), the at::mm fallback (M > 2, unaligned or strided inputs), opcheck, CUDA-graph capture; and SkinnyMMPass inside
Inductor on a decode-shaped piece (the rewritten graph calls the op and matches eager)."""

import pytest
import torch
from torch.library import opcheck

from compilelm.ops import skinny_mm
from compilelm.passes.skinny_mm import SkinnyMMPass

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # of the output's scale


def check(x, w):
    got = skinny_mm(x, w)
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
        skinny_mm(torch.randn(1, 80, device="cuda"), w)


def test_opcheck_and_graph_capture():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(100, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    opcheck(torch.ops.compilelm.skinny_mm.default, (x, w))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        skinny_mm(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_mm(x, w)
    x.copy_(torch.randn(2, 256, device="cuda", generator=g, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, skinny_mm(x, w), rtol=0, atol=0)


def test_pass_inside_inductor_matches_eager(no_tf32):
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(512, 256, bias=False)

        def forward(self, x):  # no residual add: Inductor would fold it into an addmm
            return self.down(torch.relu(self.up(x)))

    model = Layer().cuda()
    p = SkinnyMMPass()
    compiled = torch.compile(model, options={"post_grad_custom_post_pass": p, "fx_graph_cache": False})
    with torch.no_grad():
        for m in (3, 4, 7, 2, 1):
            x = torch.randn(m, 256, device="cuda")
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert p.matches == 4  # both linears of the symbolic-size graph, then of M = 1's (Dynamo specializes size 1)
