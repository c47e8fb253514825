"""The pass manager: the ordered list of passes built from a `PassConfig`, installed as
Inductor's `post_grad_custom_post_pass` for every piece.

Order (documented, fixed):

    whole graph (before the split):  NoOpElimination, <whole-graph fusions>, <custom whole-graph>
    post-grad (per piece):           NoOpElimination, UnfuseResidualAddmm, SkinnyMM, RMSNormSkinnyMM, SiluMulSkinnyMM,
                                     QKVRope, <fusions>,
                                     <custom post-grad>,
                                     then always the tail: Cleanup, InplaceLowering, Cleanup

Custom passes ("module:Class", optionally ",stage=whole_graph|post_grad" and ",before=Pass" or
",after=Pass") go at the end of their stage, or next to the named pass.

Fusions target functional ops; the tail turns them into in-place kernels once, at the very end
(no pass may run after it). `uuid()` combines every pass's uuid, so editing any pass — or
switching one on — changes Inductor's cache key and compilelm's compile cache key.
"""

from __future__ import annotations

import hashlib
import importlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from compilelm.passes.base import CompilePass
from compilelm.passes.cleanup import CleanupPass
from compilelm.passes.config import PassConfig, parse_pass_spec
from compilelm.passes.inplace_lowering import InplaceLoweringPass
from compilelm.passes.noop_elimination import NoOpEliminationPass


class PassManager(CustomGraphPass):
    def __init__(self, config: PassConfig, custom_passes: tuple[str, ...] = ()):
        self.config = config
        self.whole_graph: list[CompilePass] = []
        self.post_grad: list[CompilePass] = []
        if config.eliminate_noops:
            self.whole_graph.append(NoOpEliminationPass(config))
            self.post_grad.append(NoOpEliminationPass(config))
        if config.unfuse_residual_addmm:  # first: the fusions below may want the add
            from compilelm.passes.unfuse_residual_addmm import UnfuseResidualAddmmPass
            self.post_grad.append(UnfuseResidualAddmmPass(config))
        if config.skinny_mm:  # after the unfuse: it makes the mms this one routes
            from compilelm.passes.skinny_mm import SkinnyMMPass
            self.post_grad.append(SkinnyMMPass(config))
        if config.fuse_norm_skinny_mm:  # after SkinnyMM: it fuses into the skinny_mm nodes
            from compilelm.passes.fuse_norm_skinny_mm import RMSNormSkinnyMMFusionPass
            self.post_grad.append(RMSNormSkinnyMMFusionPass(config))
        if config.fuse_act_skinny_mm:  # after SkinnyMM, likewise
            from compilelm.passes.fuse_act_skinny_mm import SiluMulSkinnyMMFusionPass
            self.post_grad.append(SiluMulSkinnyMMFusionPass(config))
        if config.fuse_qkv_rope:  # after RMSNormSkinnyMM: it fuses into the normed projections
            from compilelm.passes.fuse_qkv_rope import QKVRopeFusionPass
            self.post_grad.append(QKVRopeFusionPass(config))
        if config.fuse_norm_gemm:  # after QKVRope and SiluMulSkinnyMM: it fuses into qkv_rope, skinny_mm_silu_mul
            from compilelm.passes.fuse_norm_gemm import NormGemmFusionPass
            self.post_grad.append(NormGemmFusionPass(config))
        # Fusion passes are appended here, in order, each behind its PassConfig switch.
        if config.fuse_allreduce_rms:
            from compilelm.passes.fuse_allreduce_rms import AllReduceRMSNormFusionPass
            self.whole_graph.append(AllReduceRMSNormFusionPass(config))
        if config.fuse_rope_attention:
            from compilelm.passes.fuse_rope_attention import RopeAttentionFusionPass
            self.whole_graph.append(RopeAttentionFusionPass(config))
        if config.fuse_norm_quant:
            from compilelm.passes.fuse_rms_quant import RMSNormQuantFusionPass
            self.post_grad.append(RMSNormQuantFusionPass(config))
        if config.fuse_act_quant:
            from compilelm.passes.fuse_act_quant import SiluMulQuantFusionPass
            self.post_grad.append(SiluMulQuantFusionPass(config))
        for spec in custom_passes:
            self._add_custom(spec)
        self.tail: list[CompilePass] = [CleanupPass(config)]
        if config.lower_inplace:
            self.tail += [InplaceLoweringPass(config), CleanupPass(config)]

    def _add_custom(self, spec: str) -> None:
        """Custom pass "module:Class[,stage=...][,before=Pass|after=Pass]": by default at the end
        of its class's stage, else next to the named pass of that stage."""
        path, stage, where = parse_pass_spec(spec)
        p = load_pass(path)(self.config)
        p.stage = stage or p.stage
        passes = self.whole_graph if p.stage == "whole_graph" else self.post_grad
        if where is None:
            passes.append(p)
            return
        side, anchor = where
        names = [q.name for q in passes]
        if anchor not in names:
            raise ValueError(f"custom_passes: {spec!r}: no pass {anchor!r} in the {p.stage} stage "
                             f"(it has: {', '.join(names) or 'none'})")
        i = names.index(anchor) if side == "before" else len(names) - names[::-1].index(anchor)
        passes.insert(i, p)

    @property
    def passes(self) -> list[CompilePass]:
        return self.whole_graph + self.post_grad + self.tail

    def set_recorder(self, recorder) -> None:
        for p in self.passes:
            p.recorder = recorder

    def run_whole_graph(self, gm: torch.fx.GraphModule) -> None:
        for p in self.whole_graph:
            p(gm.graph)
        gm.graph.lint()
        gm.recompile()

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.post_grad + self.tail:
            p(graph)

    def uuid(self) -> str:
        h = hashlib.sha256()
        for stage, passes in (("whole_graph", self.whole_graph), ("post_grad", self.post_grad + self.tail)):
            for p in passes:
                h.update(f"{stage}:{p.name}:{p.uuid()};".encode())
        return h.hexdigest()

    def uuids(self) -> dict[str, str]:
        """Pass name -> uuid, for the cache-key factors and the report."""
        stages = (("whole_graph", self.whole_graph), ("post_grad", self.post_grad + self.tail))
        return {f"{stage}.{p.name}": p.uuid() for stage, passes in stages for p in passes}


def load_pass(spec: str) -> type[CompilePass]:
    """Resolve a custom pass given as "package.module:ClassName"."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"custom_passes entries must look like 'package.module:ClassName', got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"custom_passes: cannot load {spec!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, CompilePass)):
        raise ValueError(f"custom_passes: {spec!r} is not a compilelm.passes.CompilePass subclass")
    return cls
