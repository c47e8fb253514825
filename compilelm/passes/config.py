"""Switches for compilelm's graph passes (one bool per pass), part of `CompileConfig.passes`.

A fusion pass adds its switch here, with the default it has at `-O2`; `_LEVEL_OFF` in
`compilelm/graphs/config.py` lists the switches that `-O1` turns off. User overrides always win.

Also the parser of custom-pass specs, which `CompileConfig` validates with: this module imports
no torch, so reading a config never loads the pass machinery.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class PassConfig:
    eliminate_noops: bool = True  # NoOpEliminationPass: reshape chains, identity views/slices
    lower_inplace: bool = True  # InplaceLoweringPass: functional op -> in-place kernel, late
    fuse_rope_attention: bool = True  # RopeAttentionFusionPass: (QK-norm +) RoPE + attention -> one op
    fuse_norm_quant: bool = True  # RMSNormQuantFusionPass: (add +) rms_norm + fp8 quant -> one op
    fuse_act_quant: bool = True  # SiluMulQuantFusionPass: silu_and_mul + fp8 quant -> one op
    fuse_allreduce_rms: bool = True  # AllReduceRMSNormFusionPass: TP all-reduce + add + rms_norm -> one op
    unfuse_residual_addmm: bool = True  # UnfuseResidualAddmmPass (CUDA): addmm(residual, x, w) -> mm + add
    skinny_mm: bool = True  # SkinnyMMPass (CUDA): a linear's mm -> compilelm.skinny_mm (weight streamed at M <= 2)
    fuse_norm_skinny_mm: bool = True  # RMSNormSkinnyMMFusionPass (CUDA): (add +) rms_norm + skinny_mm -> one op
    fuse_act_skinny_mm: bool = True  # SiluMulSkinnyMMFusionPass (CUDA): silu_and_mul + skinny_mm -> one op
    fuse_qkv_rope: bool = True  # QKVRopeFusionPass (CUDA): QKV projection + RoPE + cache write -> one op
    fuse_norm_gemm: bool = True  # NormGemmFusionPass (CUDA): o/down + add + RMSNorm + gate_up/qkv -> one op

    def __post_init__(self):
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"passes.{f.name} must be a bool, got {getattr(self, f.name)!r}")

    @classmethod
    def from_dict(cls, d: dict) -> PassConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown field(s) in passes: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


STAGES = ("whole_graph", "post_grad")


def parse_pass_spec(spec: str) -> tuple[str, str | None, tuple[str, str] | None]:
    """"pkg.mod:Class,stage=post_grad,after=NoOpEliminationPass" -> (path, stage, ("after", name))."""
    if not isinstance(spec, str):
        raise ValueError(f"custom_passes entries must be strings, got {spec!r}")
    path, *options = [part.strip() for part in spec.split(",")]
    stage, where = None, None
    for opt in options:
        key, sep, value = opt.partition("=")
        if not sep or not value or key not in ("stage", "before", "after"):
            raise ValueError(f"custom_passes: {spec!r}: options are stage=..., before=Pass or after=Pass, got {opt!r}")
        if key == "stage":
            if value not in STAGES:
                raise ValueError(f"custom_passes: {spec!r}: stage must be one of {', '.join(STAGES)}, got {value!r}")
            stage = value
        elif where is not None:
            raise ValueError(f"custom_passes: {spec!r}: give one of before=/after=")
        else:
            where = (key, value)
    return path, stage, where
