"""The built-in passes and their switches: `PassConfig`, part of `CompileConfig.passes`.

Each field is one built-in pass: its switch (on by default, i.e. at -O2), the class it runs
("module:Class" under compilelm.passes, imported only when a compiler is built) and the lowest
-O level it is on at (1: infrastructure, 2: fusions). Field order is run order within each stage
(a pass's class says its stage). Adding a built-in pass is its file plus one line here. User
overrides always win over the level's defaults (compilelm/graphs/config.py).

Also the parser of custom-pass specs, which `CompileConfig` validates with: this module imports
no torch, so reading a config never loads the pass machinery.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


def builtin(path: str, level: int = 2, stages: tuple[str, ...] = ()):
    """A switch field for the built-in pass `path` ("subpackage.module:Class"), on from -O`level`;
    `stages` only for a pass that runs in more than its class's stage."""
    return field(default=True, metadata={"pass": path, "level": level, "stages": stages})


@dataclass(frozen=True)
class PassConfig:
    # stage whole_graph (before the split) and post_grad (per piece), in run order
    eliminate_noops: bool = builtin("utility.noop_elimination:NoOpEliminationPass", 1, ("whole_graph", "post_grad"))
    fuse_allreduce_rms: bool = builtin("fusion.fuse_allreduce_rms:AllReduceRMSNormFusionPass")
    fuse_rope_attention: bool = builtin("fusion.fuse_rope_attention:RopeAttentionFusionPass")
    unfuse_residual_addmm: bool = builtin("utility.unfuse_residual_addmm:UnfuseResidualAddmmPass", 1)
    route_linear: bool = builtin("utility.route_linear:RouteLinearPass", 1)
    fuse_norm_linear: bool = builtin("fusion.fuse_norm_linear:RMSNormLinearFusionPass")
    fuse_act_linear: bool = builtin("fusion.fuse_act_linear:SiluMulLinearFusionPass")
    fuse_qkv_rope: bool = builtin("fusion.fuse_qkv_rope:QKVRopeFusionPass")
    fuse_norm_gemm: bool = builtin("fusion.fuse_norm_gemm:NormGemmFusionPass")
    fuse_norm_quant: bool = builtin("fusion.fuse_norm_quant:RMSNormQuantFusionPass")
    fuse_act_quant: bool = builtin("fusion.fuse_act_quant:SiluMulQuantFusionPass")
    fuse_quant_linear: bool = builtin("fusion.fuse_quant_linear:QuantLinearFusionPass")
    # the tail, after every other pass: functional ops -> in-place kernels (cleanups around it)
    lower_inplace: bool = builtin("utility.inplace_lowering:InplaceLoweringPass", 1, ("tail",))

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

    @classmethod
    def for_level(cls, level: int) -> dict:
        """The switches that are off at -O`level` (none at 2 and up)."""
        return {f.name: False for f in fields(cls) if f.metadata["level"] > level}

    def to_dict(self) -> dict:
        return asdict(self)


def builtin_passes() -> list[tuple[str, str, tuple[str, ...]]]:
    """(switch, "module:Class" under compilelm.passes, extra stages) of every built-in pass, in order."""
    return [(f.name, f.metadata["pass"], f.metadata["stages"]) for f in fields(PassConfig)]


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
