"""The FP8 W8A8 GEMM (compilelm/ops/fp8_gemm.py): the reference against an independent fp64
loop, the ops' fakes and schemas (opcheck), the layer calling `fp8_linear`, the compiled graph
holding it after the quant fusions, and the Triton kernel run by Triton's CPU interpreter against
the reference (ragged M, N and K, bias, per-tensor scales). As in test_fp8_block_gemm.py, the
interpreted tests run in a child pytest started with TRITON_INTERPRET=1 (Triton decides at import).
The CUDA kernels are tested against the same reference in tests/gpu/test_fp8_gemm_gpu.py."""

import json

import pytest
import torch

import compilelm.ops  # noqa: F401  (registers the ops)
from compilelm.ops.fp8_gemm import fp8_linear_ref, fp8_quant_linear_ref
from compilelm.ops.quant import quant_fp8_per_token_ref
from tests.triton_interpreter import INTERPRETED, run_interpreted

FP8 = torch.float8_e4m3fn


def problem(m, n, k, seed=0, bias=False, per_tensor=False):
    """fp8 x (per-token scales, or one), fp8 weight with per-channel scales (or one), optional bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.5, 4, m)[:, None]
    q, xs = quant_fp8_per_token_ref(x)
    if per_tensor:
        xs = torch.tensor([0.02])
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    ws = torch.rand(1, n, generator=g) * 0.01 + 1e-3 if not per_tensor else torch.tensor([3e-3])
    b = torch.randn(n, generator=g) if bias else None
    return q, xs, w, ws, b


def by_loop(q, xs, w, ws, b):
    """out[m, n] = sum_k q[m, k] w[n, k] * xs[m] * ws[n] (+ b[n]) in fp64, one row at a time."""
    m, n = q.shape[0], w.shape[0]
    xs = xs.double().reshape(-1).expand(m)
    ws = ws.double().reshape(-1).expand(n)
    out = torch.empty(m, n, dtype=torch.float64)
    for i in range(m):
        out[i] = (w.double() * q[i].double()).sum(1) * xs[i] * ws
    return out if b is None else out + b.double()


if not INTERPRETED:
    @pytest.mark.parametrize("m,n,k,bias,per_tensor", [(1, 48, 64, False, False), (5, 37, 80, True, False),
                                                       (70, 96, 200, False, True), (3, 16, 32, True, True)])
    def test_reference_matches_the_formula(m, n, k, bias, per_tensor):
        q, xs, w, ws, b = problem(m, n, k, bias=bias, per_tensor=per_tensor)
        want = by_loop(q, xs, w, ws, b)
        for op in (torch.ops.compilelm.fp8_linear, torch.ops.compilelm.fp8_stream_mm):
            got = op(q, xs, w, ws, b, torch.float32)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            bf16 = op(q, xs, w, ws, None if b is None else b.bfloat16(), torch.bfloat16)
            assert bf16.dtype == torch.bfloat16 and bf16.shape == (m, n)
            torch.testing.assert_close(bf16.float(), fp8_linear_ref(q, xs, w, ws, b, torch.float32).bfloat16().float(),
                                       rtol=1e-2, atol=1e-2 * want.abs().max().item())

    def test_quant_linear_is_quant_then_linear():
        g = torch.Generator().manual_seed(3)
        x = (torch.randn(5, 64, generator=g) * 3).bfloat16()
        _, _, w, ws, b = problem(5, 40, 64, bias=True)
        q, xs = quant_fp8_per_token_ref(x)
        want = fp8_linear_ref(q, xs, w, ws, b, torch.bfloat16)
        assert torch.equal(fp8_quant_linear_ref(x, w, ws, b, torch.bfloat16), want)
        assert torch.equal(torch.ops.compilelm.fp8_quant_linear(x, w, ws, b, torch.bfloat16), want)
        assert torch.equal(torch.ops.compilelm.fp8_stream_mm(x, None, w, ws, b, torch.bfloat16), want)
        utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
        torch.library.opcheck(torch.ops.compilelm.fp8_quant_linear.default, (x, w, ws, b, torch.float32),
                              test_utils=utils)
        torch.library.opcheck(torch.ops.compilelm.fp8_stream_mm.default, (x, None, w, ws, None, torch.bfloat16),
                              test_utils=utils)

    @pytest.mark.parametrize("op", ["fp8_linear", "fp8_stream_mm"])
    def test_opcheck(op):
        """opcheck without test_schema (its mutation check calls allclose, which fp8 inputs do not
        support); that check by hand: the inputs' bits are unchanged, the output aliases none."""
        q, xs, w, ws, b = problem(4, 40, 64, bias=True)
        fn = getattr(torch.ops.compilelm, op).default
        utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
        for args in ((q, xs, w, ws, b, torch.float32), (q, xs, w, ws, None, torch.bfloat16)):
            torch.library.opcheck(fn, args, test_utils=utils)
        before = [t.view(torch.uint8).clone() if t.dtype == FP8 else t.clone() for t in (q, xs, w, ws, b)]
        out = fn(q, xs, w, ws, b, torch.float32)
        after = [t.view(torch.uint8) if t.dtype == FP8 else t for t in (q, xs, w, ws, b)]
        assert all(torch.equal(x, y) for x, y in zip(before, after))
        assert all(out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in (q, xs, w, ws, b))

    def test_fake_checks_shapes():
        from torch._subclasses.fake_tensor import FakeTensorMode

        q, xs, w, ws, _ = problem(4, 40, 64)
        with FakeTensorMode() as mode:
            fq, fxs, fw, fws = (mode.from_tensor(t) for t in (q, xs, w, ws))
            assert torch.ops.compilelm.fp8_linear(fq, fxs, fw, fws, None, torch.bfloat16).shape == (4, 40)
            with pytest.raises(Exception, match="x must be fp8"):
                torch.ops.compilelm.fp8_linear(fq[:, :32], fxs, fw, fws, None, torch.bfloat16)
            with pytest.raises(Exception, match="weight_scale 40 or 1"):
                torch.ops.compilelm.fp8_linear(fq, fxs, fw, fws[:, :3], None, torch.bfloat16)

    def test_routes_are_validated():
        from compilelm.ops.fp8_gemm import set_fp8_routes

        prev = set_fp8_routes(4, 32)
        try:
            assert set_fp8_routes() == (4, 32)
            with pytest.raises(ValueError, match="stream_max_rows"):
                set_fp8_routes(stream_max_rows=17)
            with pytest.raises(ValueError, match="triton_max_rows"):
                set_fp8_routes(triton_max_rows=65)
        finally:
            set_fp8_routes(*prev)

    def test_layer_calls_fp8_linear(monkeypatch):
        from compilelm.layers.linear import Linear
        from compilelm.layers.quantization import quantize_model

        torch.manual_seed(0)
        layer = Linear(64, 48, bias=True)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.1)
        quantize_model(layer, "fp8")
        x = torch.randn(6, 64)
        calls = []
        real = torch.ops.compilelm.fp8_linear

        class Spy:
            def __call__(self, *args):
                calls.append(args)
                return real(*args)

        monkeypatch.setattr(torch.ops.compilelm, "fp8_linear", Spy())
        got = layer(x)
        assert len(calls) == 1
        q, xs = quant_fp8_per_token_ref(x)
        assert torch.equal(got, fp8_linear_ref(q, xs, layer.weight, layer.weight_scale, layer.bias, torch.float32))

    def test_compiled_graph_feeds_fused_quant_to_fp8_linear(tmp_path):
        """-O2 on CPU: the quant fusions still match, every FP8 linear is one fp8_linear node fed by
        a fused producer, or (o_proj) an fp8_quant_linear; --verify's check of every pass holds."""
        from compilelm import LLM, SamplingParams

        llm = LLM("dummy:smollm2-135m", quantization="fp8", model_overrides={"num_hidden_layers": 2},
                  max_model_len=128, num_kv_blocks=32,
                  compilation_config={"use_cache": False, "dump_dir": str(tmp_path), "verify_passes": True})
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        code = "".join(p.read_text() for p in (tmp_path / "inductor").glob("*.py"))
        assert "compilelm.fp8_linear.default" in code and "_scaled_mm" not in code
        assert "fused_add_rms_norm_quant_fp8" in code and "silu_mul_quant_fp8" in code
        assert "compilelm.fp8_quant_linear.default" in code and "quant_fp8_per_token.default" not in code
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["verify"]["requested"] and report["verify"]["max_error"] == 0.0, report["verify"]

    def test_kernel_under_the_triton_interpreter():
        pytest.importorskip("triton", minversion="3.7")
        run_interpreted(__file__)
else:
    @pytest.mark.parametrize("m,n,k,bias,per_tensor", [
        (1, 64, 256, False, False),  # one row
        (5, 200, 208, True, False),  # ragged N, K past the last 128-byte tile, bias
        (17, 96, 128, False, True),  # BM 32, per-tensor scales
        (64, 130, 400, True, False),  # BM 64, ragged N and K
    ])
    def test_triton_kernel_matches_reference(m, n, k, bias, per_tensor):
        import triton  # noqa: F401

        from compilelm.ops.fp8_gemm import fp8_mm_triton, fp8_tile_config

        q, xs, w, ws, b = problem(m, n, k, bias=bias, per_tensor=per_tensor)
        want = fp8_linear_ref(q, xs, w, ws, b, torch.float32)
        bm = fp8_tile_config(m, n, k)[0]
        # BN 64 and 128; K in 2 and 3 slices (odd K: the last slice short; 3 of 128 columns: 4 slices)
        for config in (None, (bm, 128, 128, 2), (bm, 64, 128, 2, 2), (bm, 64, 128, 2, 3)):
            got = fp8_mm_triton(q, xs, w, ws, b, torch.float32, pdl=False, config=config)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
