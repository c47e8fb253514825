"""Which FP8 checkpoint format a Hugging Face `config.json` declares (`quantization_config`), read
the way vLLM reads it, and the refusal of every other quantization method.

Served as FP8 (weights stay float8_e4m3fn with the scales published next to them):

    quant_method "fp8"                 weight_scale per tensor (or per channel), activation_scheme
                                       dynamic (per token) or static (input_scale per tensor);
                                       with weight_block_size [bn, bk]: weight_scale_inv per
                                       bn x bk block, activations dynamic per 1 x bk group
    quant_method "compressed-tensors"  (llm-compressor) one config group of float 8-bit weights:
                                       strategy tensor / channel with input activations dynamic
                                       per token or static per tensor; strategy block
                                       (block_structure [bn, bk]) with dynamic group activations
                                       (group_size bk)

Anything else (AWQ, GPTQ, bitsandbytes, int4/int8 or weight-only compressed-tensors, modelopt,
mxfp4, ...) raises `UnsupportedQuantization` at load, naming the config file, the method and
what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED = ("fp8 (per-tensor or per-channel weight scales with dynamic per-token or static per-tensor "
             "activation scales; or weight_block_size [bn, bk] with dynamic per-token-group activations) "
             "and compressed-tensors FP8 W8A8 (weights strategy tensor/channel with dynamic token or static "
             "tensor input activations; strategy block with dynamic group input activations)")


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization_config that compilelm cannot serve."""


@dataclass(frozen=True)
class Fp8Scheme:
    """An FP8 checkpoint's format.

    weights: "tensor" | "channel" | "block" (the scales on disk: [] / [out] / [ceil(out/bn), ceil(in/bk)])
    activations: "dynamic" (per token; per 1 x bk group with block weights) | "static" (input_scale [])
    """

    method: str  # config.json's quant_method: "fp8" | "compressed-tensors"
    weights: str
    activations: str
    block_size: tuple[int, int] | None = None  # (bn, bk) for weights == "block"
    weight_scale_name: str = "weight_scale"  # "weight_scale_inv" for fp8 block checkpoints
    ignore: tuple[str, ...] = ()  # checkpoint module names (or "re:<regex>") left unquantized

    def __post_init__(self):
        if self.weights not in ("tensor", "channel", "block"):
            raise ValueError(f"Fp8Scheme.weights must be tensor, channel or block, got {self.weights!r}")
        if self.activations not in ("dynamic", "static"):
            raise ValueError(f"Fp8Scheme.activations must be dynamic or static, got {self.activations!r}")
        if (self.weights == "block") != (self.block_size is not None):
            raise ValueError("Fp8Scheme.block_size is given exactly when weights == 'block'")
        if self.block_size is not None and (len(self.block_size) != 2 or min(self.block_size) <= 0):
            raise ValueError(f"Fp8Scheme.block_size must be two positive ints, got {self.block_size}")
        if self.weights == "block" and self.activations != "dynamic":
            raise ValueError("block-wise FP8 weights need dynamic activation scales")

    def is_ignored(self, module_name: str) -> bool:
        """Whether the checkpoint module `module_name` (e.g. model.layers.0.mlp.gate_proj) stays unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
            elif module_name == entry or module_name.endswith("." + entry):
                return True
        return False


def parse_quantization_config(qc: dict | None, where: str) -> Fp8Scheme | None:
    """The FP8 scheme of `qc` (config.json's quantization_config; None: an unquantized checkpoint).
    `where` names the file in errors. Raises UnsupportedQuantization for anything not served."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_fp8(qc, where)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc, where)
    raise _refuse(where, method, "")


def _refuse(where: str, method, detail: str) -> UnsupportedQuantization:
    detail = f" ({detail})" if detail else ""
    return UnsupportedQuantization(f"{where}: quantization_config.quant_method {method!r}{detail} is not supported; "
                                   f"compilelm serves {SUPPORTED}")


def _parse_fp8(qc: dict, where: str) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(where, "fp8", f"fmt {fmt!r}: only e4m3 weights")
    activations = qc.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise _refuse(where, "fp8", f"activation_scheme {activations!r}")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    block = qc.get("weight_block_size")
    if block:
        if activations != "dynamic":
            raise _refuse(where, "fp8", "weight_block_size with static activations")
        return Fp8Scheme("fp8", "block", "dynamic", _block(block, where, "fp8"), "weight_scale_inv", ignore)
    return Fp8Scheme("fp8", "tensor", activations, None, "weight_scale", ignore)


def _parse_compressed_tensors(qc: dict, where: str) -> Fp8Scheme:
    m = "compressed-tensors"
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _refuse(where, m, "no config_groups")
    if any(g != groups[0] for g in groups[1:]):
        raise _refuse(where, m, "several different config_groups")
    group = groups[0]
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _refuse(where, m, f"targets {targets}: only ['Linear']")
    w, a = group.get("weights") or {}, group.get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(where, m, f"weights {w.get('type')} {w.get('num_bits')}-bit: only float 8-bit (FP8)")
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise _refuse(where, m, "asymmetric or dynamic FP8 weights")
    if group.get("output_activations"):
        raise _refuse(where, m, "output_activations")
    if not a:
        raise _refuse(where, m, "FP8 weight-only (W8A16): no input_activations")
    if a.get("type") != "float" or a.get("num_bits") != 8 or not a.get("symmetric", True):
        raise _refuse(where, m, f"input activations {a.get('type')} {a.get('num_bits')}-bit: only symmetric FP8")
    ignore = tuple(qc.get("ignore") or ())
    wstrategy, astrategy, dynamic = w.get("strategy"), a.get("strategy"), bool(a.get("dynamic"))
    if wstrategy == "block":
        block = _block(w.get("block_structure"), where, m)
        if not (dynamic and astrategy == "group" and a.get("group_size") == block[1]):
            raise _refuse(where, m, f"block weights need dynamic group activations of group_size {block[1]}")
        return Fp8Scheme(m, "block", "dynamic", block, "weight_scale", ignore)
    if wstrategy not in ("tensor", "channel"):
        raise _refuse(where, m, f"FP8 weights strategy {wstrategy!r}")
    if dynamic and astrategy == "token":
        return Fp8Scheme(m, wstrategy, "dynamic", None, "weight_scale", ignore)
    if not dynamic and astrategy == "tensor":
        return Fp8Scheme(m, wstrategy, "static", None, "weight_scale", ignore)
    raise _refuse(where, m, f"{'dynamic' if dynamic else 'static'} input activations of strategy {astrategy!r}")


def _block(block, where: str, method: str) -> tuple[int, int]:
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise _refuse(where, method, f"block size {block!r}: two positive ints expected")
    return int(block[0]), int(block[1])
