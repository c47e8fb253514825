"""`CompileConfig`: how compilelm compiles a model (frozen, validated, one JSON-overridable field
per knob). Built from the CLI with `CompileConfig.from_cli(level, overrides_json, enforce_eager)`.

Levels (user-set fields always win over the level's defaults):
    -O0  eager: no Dynamo, no Inductor (compile_model returns model.forward)
    -O1  compile piecewise; infrastructure passes only; piecewise CUDA graphs
    -O2  (default) every pass on; full + piecewise CUDA graphs on GPU
    -O3  -O2 + static compile sizes compiled with Inductor max-autotune
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields

from compilelm.passes.config import PassConfig, parse_pass_spec

CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_and_piecewise")

# Per-level defaults; -O2 is the dataclass defaults. The pass switches that -O1 turns off come
# from compilelm/passes/config.py (each built-in pass's level).
_LEVEL_DEFAULTS: dict[int, dict] = {
    0: {"cudagraph_mode": "none"},
    1: {"cudagraph_mode": "piecewise", "passes": PassConfig.for_level(1)},
    2: {},
    3: {"compile_sizes": (1, 2, 4, 8), "max_autotune": True},
}


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/compilelm/compile, else ~/.cache/compilelm/compile."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "compilelm", "compile")


@dataclass(frozen=True)
class CompileConfig:
    level: int = 2
    # Ops the graph is split at ("namespace::name"); each stays an opaque call between pieces.
    splitting_ops: tuple[str, ...] = ("compilelm::unified_attention", "compilelm::unified_attention_rope",
                                      "compilelm::unified_attention_qknorm_rope",
                                      "compilelm::unified_attention_rotated")
    # Token counts compiled with static shapes besides the symbolic range.
    compile_sizes: tuple[int, ...] = ()
    max_autotune: bool = False  # Inductor max-autotune for the static compile sizes
    # Extra torch._inductor.config settings for every piece, e.g. {"cpp.threads": 1} (given as a
    # JSON object; stored as sorted (name, value) pairs so the config stays hashable).
    inductor_options: tuple[tuple[str, object], ...] = ()
    passes: PassConfig = field(default_factory=PassConfig)
    custom_passes: tuple[str, ...] = ()  # "package.module:PassClass", run after built-in passes
    cache_dir: str | None = None  # None = default_cache_dir()
    inductor_cache_dir: str | None = None  # Inductor's own cache (C++/Triton builds); None = <cache_dir>/inductor
    use_cache: bool = True
    # CUDA graphs (filled in by the GPU runner): mode and batch sizes to capture (empty = default list).
    cudagraph_mode: str = "full_and_piecewise"
    cudagraph_capture_sizes: tuple[int, ...] = ()
    # Debugging, never part of the cache key: write `compilelm compile --dump` output here, and
    # check every pass numerically (graph before vs after on random inputs).
    dump_dir: str | None = None
    verify_passes: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if isinstance(self.passes, dict):
            set_("passes", PassConfig.from_dict(self.passes))
        options = self.inductor_options
        if isinstance(options, dict):
            options = tuple(sorted(options.items()))
        if not isinstance(options, (list, tuple)) or not all(
                isinstance(kv, (list, tuple)) and len(kv) == 2 and isinstance(kv[0], str) for kv in options):
            raise ValueError("inductor_options must be an object of Inductor config settings, got "
                             f"{self.inductor_options!r}")
        set_("inductor_options", tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in options))
        for name in ("splitting_ops", "compile_sizes", "custom_passes", "cudagraph_capture_sizes"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {value!r}")
            set_(name, tuple(value))
        if type(self.level) is not int or not 0 <= self.level <= 3:
            raise ValueError(f"level must be 0, 1, 2 or 3, got {self.level!r}")
        for op in self.splitting_ops:
            if not isinstance(op, str) or "::" not in op:
                raise ValueError(f"splitting_ops entries must look like 'namespace::op', got {op!r}")
        for name in ("compile_sizes", "cudagraph_capture_sizes"):
            sizes = getattr(self, name)
            if any(type(s) is not int or s < 1 for s in sizes):
                raise ValueError(f"{name} must hold positive ints, got {list(sizes)}")
            set_(name, tuple(sorted(set(sizes))))
        for spec in self.custom_passes:
            if not isinstance(spec, str) or ":" not in spec:
                raise ValueError(f"custom_passes entries must look like 'package.module:Class', got {spec!r}")
            parse_pass_spec(spec)  # stage=/before=/after= options
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {self.cudagraph_mode!r}")
        for name in ("max_autotune", "use_cache", "verify_passes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("cache_dir", "inductor_cache_dir", "dump_dir"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a path string, got {getattr(self, name)!r}")

    @classmethod
    def for_level(cls, level: int, **overrides) -> CompileConfig:
        """The level's defaults with `overrides` (field name -> value) applied on top."""
        if type(level) is not int or level not in _LEVEL_DEFAULTS:
            raise ValueError(f"level must be 0, 1, 2 or 3, got {level!r}")
        known = {f.name for f in fields(cls)} - {"level"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown compilation config field(s): {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        merged = {**_LEVEL_DEFAULTS[level], **overrides}
        if "passes" in merged:
            user = overrides.get("passes", {})
            user = user.to_dict() if isinstance(user, PassConfig) else user
            if not isinstance(user, dict):
                raise ValueError(f"passes must be an object of switches, got {user!r}")
            merged["passes"] = PassConfig.from_dict({**_LEVEL_DEFAULTS[level].get("passes", {}), **user})
        return cls(level=level, **merged)

    @classmethod
    def from_cli(cls, level: int | None = None, overrides_json: str | None = None,
                 enforce_eager: bool = False) -> CompileConfig:
        """From `-O<level>`, `--compilation-config JSON` and `--enforce-eager` (which wins)."""
        overrides = {}
        if overrides_json:
            try:
                overrides = json.loads(overrides_json)
            except json.JSONDecodeError as e:
                raise ValueError(f"compilation config is not valid JSON: {e}") from e
            if not isinstance(overrides, dict):
                raise ValueError(f"compilation config must be a JSON object, got {overrides_json!r}")
        json_level = overrides.pop("level", None)
        if level is not None and json_level is not None and level != json_level:
            raise ValueError(f"level given twice: -O{level} and compilation config level={json_level}")
        level = 0 if enforce_eager else (level if level is not None else json_level if json_level is not None else 2)
        if enforce_eager:
            overrides["cudagraph_mode"] = "none"
        return cls.for_level(level, **overrides)

    @property
    def resolved_cache_dir(self) -> str:
        return os.path.abspath(os.path.expanduser(self.cache_dir or default_cache_dir()))

    @property
    def resolved_inductor_cache_dir(self) -> str:
        if self.inductor_cache_dir:
            return os.path.abspath(os.path.expanduser(self.inductor_cache_dir))
        return os.path.join(self.resolved_cache_dir, "inductor")

    def cache_key_dict(self) -> dict:
        """The fields that can change a compiled piece. Paths, cache switches, debugging and
        CUDA-graph sizes (captured at run time, not compiled) are left out."""
        skip = {"cache_dir", "inductor_cache_dir", "use_cache", "dump_dir", "verify_passes",
                "cudagraph_mode", "cudagraph_capture_sizes"}
        return {k: v for k, v in asdict(self).items() if k not in skip}
