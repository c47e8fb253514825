"""RoPE (+ QK-norm) + attention fusion: toy graphs (op counts, numerics vs eager, the cache holds
rotated K), a dummy Qwen3 and, slow, the default model (one match per layer, greedy unchanged)."""

import json

import pytest
import torch
from torch import nn

from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from compilelm.graphs import CompileConfig
from compilelm.layers.attention import Attention
from compilelm.layers.layernorm import RMSNorm
from compilelm.layers.rotary_embedding import RotaryEmbedding
from compilelm.passes import PassConfig, PassManager
from compilelm.passes.debug.testing import check_pass
from compilelm.passes.fusion.fuse_rope_attention import RopeAttentionFusionPass

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 16
ROPE_OPS = ("aten.index.Tensor", "aten.cat.default", "aten.sub.Tensor", "aten.rsqrt.default")


class ToyAttention(nn.Module):
    """qkv -> (QK-norm) -> RoPE -> unified_attention -> o, as LlamaAttention / Qwen3Attention."""

    def __init__(self, qk_norm: bool, dtype=torch.float32, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.q_size, self.kv_size = heads * HEAD_DIM, KV_HEADS * HEAD_DIM
        self.qkv = nn.Linear(64, self.q_size + 2 * self.kv_size, bias=False, dtype=dtype)
        self.o = nn.Linear(self.q_size, 64, bias=False, dtype=dtype)
        self.rope = RotaryEmbedding(HEAD_DIM, 256, 10000.0)
        self.q_norm = RMSNorm(HEAD_DIM).to(dtype) if qk_norm else None
        self.k_norm = RMSNorm(HEAD_DIM).to(dtype) if qk_norm else None
        if qk_norm:
            self.q_norm.weight.data.uniform_(0.5, 1.5)
            self.k_norm.weight.data.uniform_(0.5, 1.5)
        self.attn = Attention(heads, KV_HEADS, HEAD_DIM, "layer0")

    def forward(self, x, positions):
        n = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.view(n, self.heads, HEAD_DIM)).view(n, self.q_size)
            k = self.k_norm(k.view(n, KV_HEADS, HEAD_DIM)).view(n, self.kv_size)
        q, k = self.rope(positions, q, k)
        return self.o(self.attn(q, k, v))


def paged_context(n: int, dtype=torch.float32):
    """One sequence of n prompt tokens in fresh blocks 1.."""
    blocks = list(range(1, -(-n // BLOCK) + 1))
    shape = (len(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM)
    caches = {"layer0": (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))}
    meta = AttentionMetadata(torch.arange(BLOCK, BLOCK + n), torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.tensor([blocks], dtype=torch.int32), n, n)
    return ForwardContext(meta, caches)


@pytest.mark.parametrize("qk_norm,heads", [(False, HEADS), (False, 40), (True, HEADS)])
def test_toy_attention_fused_counts_and_numerics(qk_norm, heads):
    model, n = ToyAttention(qk_norm, heads=heads), 11
    x, positions = torch.randn(n, 64), torch.arange(5, 5 + n)
    if qk_norm:
        fused_ops = {"compilelm.unified_attention_qknorm_rope.default": 1}
    else:  # small (128 wide) or wide (1280): RoPE + the cache write before the split, the attention op after it
        fused_ops = {"compilelm.unified_attention_rope.default": 0, "compilelm.rope_cache.default": 1,
                     "compilelm.unified_attention_rotated.default": 1}
    ctx = paged_context(n)
    p = RopeAttentionFusionPass()
    result = check_pass(model, [x, positions], [p], matches={p.name: 1},
                        ops_before={"compilelm.unified_attention.default": 1, "aten.cat.default": 2},
                        ops_after={"compilelm.unified_attention.default": 0, **fused_ops},
                        atol=1e-5, context=lambda: set_forward_context(ctx))
    if not qk_norm:  # without fuse_qkv_rope, RoPE goes inside the attention op
        plain = check_pass(model, [x, positions], [RopeAttentionFusionPass(PassConfig(fuse_qkv_rope=False))], atol=1e-5,
                           ops_after={"compilelm.unified_attention_rope.default": 1, "compilelm.rope_cache.default": 0},
                           context=lambda: set_forward_context(paged_context(n)))
        assert plain.max_error <= 1e-5
    for op in ROPE_OPS:  # no RoPE / norm math is left outside the fused op
        assert result.ops_after[op] == 0, result.graph.code
    assert result.ops_before["aten.rsqrt.default"] == (2 if qk_norm else 0)
    # the fused op wrote ROTATED k into the cache: equal to what the eager model writes
    eager_ctx = paged_context(n)
    with torch.no_grad(), set_forward_context(eager_ctx):
        model(x, positions)
    torch.testing.assert_close(ctx.kv_caches["layer0"][0], eager_ctx.kv_caches["layer0"][0], atol=1e-6, rtol=0)


def test_bf16_with_fp32_cos_sin_cache():
    model, n = ToyAttention(True, torch.bfloat16), 7
    x, positions = torch.randn(n, 64, dtype=torch.bfloat16), torch.arange(n)
    ctx = paged_context(n, torch.bfloat16)
    assert model.rope.cos_sin_cache.dtype == torch.float32  # the cast of cos/sin is in the pattern
    p = RopeAttentionFusionPass()
    check_pass(model, [x, positions], [p], matches={p.name: 1}, atol=1e-2,
               ops_after={"compilelm.unified_attention_qknorm_rope.default": 1, "aten.cat.default": 0},
               context=lambda: set_forward_context(ctx))


def test_not_fused_when_rotated_q_has_another_user():
    class Leaky(ToyAttention):
        def forward(self, x, positions):
            q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.rope(positions, q, k)
            return self.o(self.attn(q, k, v)) + q.sum()

    model, n = Leaky(False), 6
    ctx = paged_context(n)
    p = RopeAttentionFusionPass()
    result = check_pass(model, [torch.randn(n, 64), torch.arange(n)], [p], matches={p.name: 0},
                        ops_after={"compilelm.unified_attention.default": 1}, context=lambda: set_forward_context(ctx))
    assert result.max_error <= 1e-5


def test_switch_levels_and_splitting_ops():
    assert CompileConfig.for_level(2).passes.fuse_rope_attention
    assert not CompileConfig.for_level(1).passes.fuse_rope_attention
    assert {"compilelm::unified_attention_rope",
            "compilelm::unified_attention_rotated"} <= set(CompileConfig().splitting_ops)
    on = [p.name for p in PassManager(PassConfig()).whole_graph]
    off = [p.name for p in PassManager(PassConfig(fuse_rope_attention=False)).whole_graph]
    assert on[0] == "NoOpEliminationPass" and "RopeAttentionFusionPass" in on
    assert "RopeAttentionFusionPass" not in off
    assert "QKVRopeFusionPass" in [p.name for p in PassManager(PassConfig()).post_grad]
    assert "QKVRopeFusionPass" not in [p.name for p in PassManager(PassConfig(fuse_qkv_rope=False)).post_grad]
    assert not CompileConfig.for_level(1).passes.fuse_qkv_rope


def _tiny(preset_layers=2):
    return {"num_hidden_layers": preset_layers, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}


def test_dummy_qwen3_one_match_per_layer_equals_eager(tmp_path, inductor_dir):
    from compilelm import LLM, SamplingParams
    from compilelm.graphs import compile_counters

    dump = tmp_path / "dump"
    cc = {"cache_dir": str(tmp_path / "cache"), "inductor_cache_dir": inductor_dir, "dump_dir": str(dump)}
    before = compile_counters.snapshot()
    compiled = LLM("dummy:qwen3-0.6b", model_overrides=_tiny(), compilation_config=cc)
    assert compile_counters.delta(before)["pieces"] == 2 + 1
    report = json.loads((dump / "report.json").read_text())
    fusion = [p for p in report["passes"] if p["pass"] == "RopeAttentionFusionPass"]
    assert len(fusion) == 1 and fusion[0]["matches"] == 2  # one QK-norm + RoPE + attention per layer
    stitched = (dump / "05_stitched_graph.py").read_text()
    assert stitched.count("'model.layers.") == 2
    eager = LLM("dummy:qwen3-0.6b", model_overrides=_tiny(), enforce_eager=True)
    prompts = [[1, 17, 230, 9, 44, 100, 5], list(range(100, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    for c, e in zip(compiled.generate(prompts, params, use_tqdm=False),
                    eager.generate(prompts, params, use_tqdm=False)):
        assert c.outputs[0].token_ids == e.outputs[0].token_ids
        for step_c, step_e in zip(c.outputs[0].logprobs, e.outputs[0].logprobs):
            for tok in step_e:
                assert step_c[tok].logprob == pytest.approx(step_e[tok].logprob, abs=1e-4)


@pytest.mark.slow
def test_default_model_one_match_per_layer_greedy_unchanged(tmp_path, inductor_dir, capsys):
    from compilelm import LLM, SamplingParams
    from compilelm.entrypoints.cli import main as cli_main

    dump = tmp_path / "dump"
    cc = json.dumps({"cache_dir": str(tmp_path / "cache"), "inductor_cache_dir": inductor_dir})
    assert cli_main(["compile", "--dump", str(dump), "--verify", "-cc", cc]) == 0
    report = json.loads((dump / "report.json").read_text())
    fusion = [p for p in report["passes"] if p["pass"] == "RopeAttentionFusionPass"]
    assert fusion[0]["matches"] == 30 and fusion[0]["max_error"] == 0.0
    assert report["counters"]["pieces"] == 31
    aten = (dump / "03_after_whole_graph_passes.py").read_text()
    # 576 wide (small): RoPE + the cache write before the split, attention after it; the pieces
    # name no layer, so the 29 middle layers' pieces are one (31 pieces, 3 unique)
    assert aten.count("compilelm.rope_cache.default(") == 30
    assert aten.count("compilelm.unified_attention_rotated.default(") == 30
    assert report["counters"]["unique_pieces"] == 3
    assert "aten.index.Tensor" not in aten and "aten.cat.default" not in aten  # no RoPE math left
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    compiled = LLM(compilation_config=json.loads(cc))
    eager = LLM(enforce_eager=True)
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want
