"""NormGemmFusionPass: projection -> residual add -> weightless RMSNorm -> projection (gate_up with
SiLU-and-mul, or the QKV projection with RoPE and the cache write) becomes one op. The graph is
traced as Inductor's post-grad graphs look on CUDA (fake CUDA tensors, symbolic M), taken through
RouteLinearPass, then rewritten; the result runs on real CPU tensors (the ops' CPU kernels are the
unfused compositions) against the eager function, bit for bit, the KV cache included. Also the
load-time fold of the norm weights it relies on (the pass's prepare_model)."""

import pytest
import torch
from torch.library import opcheck

from compilelm.forward_context import set_forward_context
from compilelm.ops.norm import rms_norm
from compilelm.passes import PassConfig
from compilelm.passes.fusion import fuse_norm_gemm
from compilelm.passes.fusion.fuse_norm_gemm import NormGemmFusionPass
from tests.compile.test_fuse_qkv_rope import HEAD_DIM, HEADS, HIDDEN, WIDTHS, M, context
from tests.compile.test_route_linear import EPS, linear_then, targets

ops = torch.ops.compilelm
INTER = 48


def mlp(a, w_o, residual, w_gu):
    """o_proj, the residual add, the folded (weightless) post-attention norm, gate_up + SiLU-and-mul."""
    h = torch.mm(a, w_o.t()) + residual
    return ops.gate_up_silu_mul(rms_norm(h, None, EPS), w_gu), h


def next_qkv(a, w_d, residual, w_qkv, positions, cos_sin_cache):
    """down_proj, the residual add, the next layer's folded input norm, its QKV projection + RoPE."""
    h = torch.mm(a, w_d.t()) + residual
    return ops.qkv_rope(rms_norm(h, None, EPS), w_qkv, positions, cos_sin_cache, HEADS), h


def weighted(a, w_o, residual, norm_w, w_gu):
    """A norm that kept its weight (not folded): no match."""
    h = torch.mm(a, w_o.t()) + residual
    return ops.gate_up_silu_mul(rms_norm(h, norm_w, EPS), w_gu), h


def shared_product(a, w_o, residual, w_gu):
    """o_proj's product also feeds something else: no match."""
    y = torch.mm(a, w_o.t())
    h = y + residual
    return ops.gate_up_silu_mul(rms_norm(h, None, EPS), w_gu), h, y.sum()


def inputs(fn, dtype):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    a, residual, w_o = rand(M, 24), rand(M, HIDDEN), rand(HIDDEN, 24)
    if fn is next_qkv:
        return [a, w_o, residual, rand(sum(WIDTHS), HIDDEN), torch.tensor([3, 9, 0]),
                torch.randn(16, HEAD_DIM, generator=gen)]
    if fn is weighted:
        return [a, w_o, residual, (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype), rand(2 * INTER, HIDDEN)]
    return [a, w_o, residual, rand(2 * INTER, HIDDEN)]


def rewrite(fn, args, dtype):
    fusion = NormGemmFusionPass()
    extra = args[-2:] if fn is next_qkv else ()
    shapes = [tuple(t.shape) for t in (args[:-2] if extra else args)]
    gm, skinny, _ = linear_then(fusion, fn, shapes, dtype, extra=extra)
    return gm, fusion


FUSED = {mlp: ops.linear_add_rms_norm_gate_up_silu_mul.default, next_qkv: ops.linear_add_rms_norm_qkv_rope.default}


@pytest.mark.parametrize("fn", [mlp, next_qkv])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_between_projections_fuses(fn, dtype):
    args = inputs(fn, dtype)
    gm, fusion = rewrite(fn, args, dtype)
    t = targets(gm)
    assert fusion.matches == 1 and t.count(FUSED[fn]) == 1, gm.code
    assert not {ops.linear.default, ops.gate_up_silu_mul.default, ops.qkv_rope.default, torch.ops.aten.mean.dim,
                torch.ops.aten.rsqrt.default} & set(t)
    got_ctx, want_ctx = context(dtype), context(dtype)
    with set_forward_context(got_ctx):
        got = gm(*args)
    with set_forward_context(want_ctx):
        want = fn(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(got_ctx.kv_caches["layer0"], want_ctx.kv_caches["layer0"]):
        assert torch.equal(g, w)
    if fn is next_qkv:
        assert got_ctx.kv_caches["layer0"][0].abs().sum() > 0  # the cache rows were written


@pytest.mark.parametrize("fn", [weighted, shared_product])
def test_weighted_norms_and_shared_products_are_kept(fn):
    args = inputs(fn, torch.bfloat16)
    gm, fusion = rewrite(fn, args, torch.bfloat16)
    assert fusion.matches == 0 and ops.gate_up_silu_mul.default in targets(gm)


def test_ops_cpu_match_reference_and_opcheck():
    dtype = torch.bfloat16
    a, w_o, residual, w_gu = inputs(mlp, dtype)
    act, h = ops.linear_add_rms_norm_gate_up_silu_mul(a, w_o, residual, EPS, w_gu)
    want_act, want_h = mlp(a, w_o, residual, w_gu)
    assert torch.equal(act, want_act) and torch.equal(h, want_h) and act.shape == (M, INTER)
    opcheck(ops.linear_add_rms_norm_gate_up_silu_mul.default, (a, w_o, residual, EPS, w_gu))
    with pytest.raises(RuntimeError, match="residual"):
        ops.linear_add_rms_norm_gate_up_silu_mul(a, w_o, residual[:, :8], EPS, w_gu)


def _llama(preset: str, overrides: dict, dtype=torch.float32, device="cpu"):
    from compilelm.models.loader import build_model, load_model_config, resolve_model

    source = resolve_model(preset)
    return build_model(source, load_model_config(source, overrides), dtype, torch.device(device))


def test_fold_moves_norm_weights_into_the_projections():
    """rms_norm(x, g) @ W.T == rms_norm(x, None) @ (W * g).T: a small Llama's layer in fp32 computes
    the same QKV and gate_up products after the fold, and its two norms have no weight."""
    model = _llama("dummy:smollm2-135m", {"num_hidden_layers": 2})
    gen = torch.Generator().manual_seed(0)
    for layer in model.model.layers:  # dummy norms are ones: make the fold matter
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data = torch.rand(norm.weight.shape, generator=gen) + 0.5
    x = torch.randn(3, model.config.hidden_size, generator=gen)
    layer = model.model.layers[1]

    def products():
        return (layer.self_attn.qkv_proj(layer.input_layernorm(x)),
                layer.mlp.gate_up_proj(layer.post_attention_layernorm(x)))

    before = products()
    layers = fuse_norm_gemm._llama_layers(model)
    assert len(layers) == 2
    fuse_norm_gemm.fold_norm_weights(layers)
    assert layer.input_layernorm.weight is None and layer.post_attention_layernorm.weight is None
    for got, want in zip(products(), before):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert model.model.norm.weight is not None  # the final norm (before the LM head) is kept
    assert fuse_norm_gemm._llama_layers(model) == []  # folded once: a second compile leaves it alone


def test_prepare_model_runs_in_the_compiler_and_is_reported(monkeypatch):
    """The compiler runs every pass's prepare_model before tracing (warm or cold) and reports what
    it did; the pass folds only the layers it said it will take."""
    from compilelm.graphs import CompiledModel
    from compilelm.graphs.config import CompileConfig

    model = _llama("dummy:smollm2-135m", {"num_hidden_layers": 2})
    seen = []
    monkeypatch.setattr(NormGemmFusionPass, "takes_layers",
                        lambda self, m: seen.append(m) or fuse_norm_gemm._llama_layers(m))
    config = CompileConfig.for_level(2, use_cache=False)
    cm = CompiledModel(model, config, {"test": "prepare_model"})
    cm.compile()
    assert seen == [model]
    assert cm.load_rewrites == ["NormGemmFusionPass: the input and post-attention RMSNorm weights of 2 layers "
                                "folded into qkv_proj and gate_up_proj"]
    assert all(layer.input_layernorm.weight is None for layer in model.model.layers)


def test_fold_applies_only_where_the_fused_kernels_run():
    model = _llama("dummy:smollm2-135m", {"num_hidden_layers": 1})
    p = NormGemmFusionPass(PassConfig())
    assert p.takes_layers(model) == [] and p.prepare_model(model) is None  # no sm_90 here
    assert model.model.layers[0].input_layernorm.weight is not None
    assert fuse_norm_gemm._llama_layers(model)  # a Llama-family model without QK-norm: the fold's shape
    assert not fuse_norm_gemm.shapes_fit(model.model.layers[0])  # hidden 576: too small for the Hopper GEMM


@pytest.mark.parametrize("overrides, fits", [({}, True), ({"intermediate_size": 2048}, False),
                                             ({"hidden_size": 3072, "num_attention_heads": 24}, False)])
def test_fold_fits_only_the_shapes_both_ops_take(overrides, fits):
    """Llama-3.1-8B's layer fits; with intermediate 2048 fuse_act_linear moves the SiLU into
    down_proj (no gate_up_silu_mul, no linear before the QKV norm), and hidden 3072 / 64 = 48
    blocks is no power of two. (Shapes only: the model is built on the meta device.)"""
    from compilelm.models.loader import load_model_config, resolve_model
    from compilelm.models.registry import get_model_class

    config = load_model_config(resolve_model("dummy:llama-3.1-8b"), {"num_hidden_layers": 1, **overrides})
    with torch.device("meta"):
        model = get_model_class(config)(config)
    assert fuse_norm_gemm.shapes_fit(model.model.layers[0]) == fits


def test_building_the_model_leaves_the_compiler_to_the_priming_thread():
    """The worker builds the model on its main thread while another thread imports the compiler
    (worker._prime_compiler): a second import of Inductor's modules from the main thread at that time
    met a partly initialized module on the H100 (ImportError, torch._inductor.utils). So building a
    model imports nothing of compilelm.passes, compilelm.graphs or torch._inductor; the passes'
    load-time rewrites run later, inside the compiler."""
    import subprocess
    import sys

    code = """
import sys, torch
from compilelm.models.loader import build_model, load_model_config, resolve_model
source = resolve_model("dummy:llama-3.2-1b")
model = build_model(source, load_model_config(source, {"num_hidden_layers": 1}), torch.float32, torch.device("cpu"))
print(sorted(m for m in sys.modules if m.startswith(("compilelm.passes", "torch._inductor", "compilelm.graphs"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
