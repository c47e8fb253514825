"""Load an FP8 checkpoint (scheme.py's formats) as FP8: the decoder's linears keep the published
float8_e4m3fn weights and scales, bit for bit.

    prepare_fp8_checkpoint(model, scheme)   before loading: each quantized linear gets
        weight        fp8 [out, in]                                   (this rank's rows / columns)
        weight_scale  fp32 [1, out]  tensor / channel: one scale per output row (a per-tensor scale
                                     is repeated over its shard's rows)
                      fp32 [ceil(out / bn), ceil(in / bk)]  block
        input_scale   fp32 [1]       static activations only: the max over packed shards
    fp8_checkpoint_tensors(weights, scheme)  the checkpoint's tensors, renamed / filtered for the loader
    finalize_fp8_checkpoint(model, scheme)   after loading: checks every scale arrived, sets quant_method

Packed layers (q|k|v -> qkv_proj, gate|up -> gate_up_proj) with per-tensor scales: each shard's
published scale stays on its own rows (a per-channel scale vector), so no weight is re-quantized
and the numbers are the checkpoint's. vLLM instead re-quantizes the shards to their max scale
(its per-tensor CUTLASS GEMM takes one scale); here `compilelm::fp8_linear`'s kernels
(compilelm/ops/fp8_gemm.py) take the vector at the same cost. Static input scales of packed shards
(one input, calibrated per shard) become their max, as in vLLM. Block scales of packed shards
stack along the rows: every shard's rows must be a multiple of bn (as vLLM requires).

KV-cache scales (an FP8 KV cache's, `split_kv_scales`): `*.self_attn.k_scale` / `.v_scale` (FP8 /
modelopt / newer compressed-tensors checkpoints), `*.self_attn.kv_scale` (one for both, older FP8
checkpoints), `*.self_attn.k_proj.output_scale` / `v_proj.output_scale` (compressed-tensors
`kv_cache_scheme`) go to the layer's Attention (k_scale, v_scale; `apply_kv_scales`), used where the
KV cache is fp8 (--kv-cache-dtype fp8). Query and probability scales (q_scale, prob_scale,
q_proj.output_scale) are dropped: queries stay in the model dtype. Zero points of symmetric schemes
(all zero) are dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from compilelm.distributed.parallel_state import get_tp_rank
from compilelm.layers.linear import ColumnParallelLinear, Linear, MergedColumnParallelLinear, RowParallelLinear
from compilelm.layers.quantization.fp8 import Fp8BlockLinearMethod, Fp8LinearMethod, fp8_linears
from compilelm.layers.quantization.scheme import Fp8Scheme
from compilelm.ops.quant import FP8_DTYPE

logger = logging.getLogger("compilelm")

KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale")


def checkpoint_module_names(model: nn.Module, name: str) -> list[str]:
    """The checkpoint's module names that load into our layer `name` (q/k/v_proj for qkv_proj)."""
    prefix, _, last = name.rpartition(".")
    frags = [frag for frag, (ours, _) in getattr(model, "packed_modules", {}).items() if ours == last]
    return [f"{prefix}.{frag}" for frag in frags] or [name]


def prepare_fp8_checkpoint(model: nn.Module, scheme: Fp8Scheme) -> list[str]:
    """Gives the linears the scheme quantizes their fp8 parameters (module docstring); returns their names."""
    quantized = []
    for name, layer in list(fp8_linears(model)):
        sources = checkpoint_module_names(model, name)
        ignored = [scheme.is_ignored(s) for s in sources]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(f"{name}: the checkpoint leaves {[s for s, i in zip(sources, ignored) if i]} "
                             f"unquantized but not the other shards {sources}; compilelm packs them in one layer")
        _make_fp8_params(layer, scheme, name)
        quantized.append(name)
    return quantized


def _kv_scale_target(name: str) -> tuple[str, str] | None:
    """(attention module prefix `...self_attn`, "k" | "v" | "kv" | "") of a KV-cache scale tensor's
    name ("": a query / probability scale, dropped), None if `name` is no such scale."""
    for suffix, which in ((".k_proj.output_scale", "k"), (".v_proj.output_scale", "v"),
                          (".q_proj.output_scale", "")):
        if name.endswith(suffix):
            return name[: -len(suffix)], which
    if name.endswith(".output_scale"):
        return None
    for suffix in KV_SCALE_SUFFIXES:
        if name.endswith(suffix):
            prefix = name[: -len(suffix)]
            for tail in (".attn", ".k_proj", ".v_proj", ".q_proj"):  # self_attn.attn.k_scale, self_attn.k_proj.k_scale
                prefix = prefix.removesuffix(tail)
            return prefix, {".k_scale": "k", ".v_scale": "v", ".kv_scale": "kv"}.get(suffix, "")
    return None


def split_kv_scales(weights: Iterable[tuple[str, torch.Tensor]], sink: dict[str, dict[str, float]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without its KV-cache scales, which go to `sink` as
    {"<...>.self_attn": {"k": k_scale, "v": v_scale}} (for `apply_kv_scales`). A per-head scale
    vector becomes its maximum (per-tensor scales only: a larger scale never saturates)."""
    for name, tensor in weights:
        target = _kv_scale_target(name)
        if target is None:
            yield name, tensor
            continue
        prefix, which = target
        if not which:
            logger.debug("%s: query / probability scales are not used (queries stay in the model dtype)", name)
            continue
        values = tensor.float().reshape(-1)
        if values.numel() > 1:
            logger.warning("%s: %d per-head KV-cache scales; compilelm takes per-tensor scales, their max %g",
                           name, values.numel(), float(values.max()))
        value = float(values.max())
        if not (value > 0 and value != float("inf")):
            raise ValueError(f"{name}: a KV-cache scale must be finite and > 0, got {value}")
        for w in which:
            sink.setdefault(prefix, {})[w] = value


def apply_kv_scales(model: nn.Module, scales: dict[str, dict[str, float]]) -> None:
    """Gives each `<prefix>.attn` Attention layer its k_scale / v_scale from `split_kv_scales`'s sink."""
    for prefix, kv in scales.items():
        try:
            attn = model.get_submodule(f"{prefix}.attn")
        except AttributeError:
            raise ValueError(f"checkpoint KV-cache scales for {prefix!r}: the model has no attention layer "
                             f"{prefix}.attn") from None
        attn.k_scale = kv.get("k", attn.k_scale)
        attn.v_scale = kv.get("v", attn.v_scale)
        attn.kv_scales_loaded = True


def fp8_checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme,
                           kv_scales: dict[str, dict[str, float]] | None = None
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under our parameter names: weight_scale_inv -> weight_scale,
    KV-cache scales into `kv_scales` (`split_kv_scales`; dropped if None), all-zero zero points
    dropped."""
    for name, tensor in split_kv_scales(weights, {} if kv_scales is None else kv_scales):
        if name.endswith("_zero_point"):
            if tensor.count_nonzero():
                raise ValueError(f"{name}: non-zero zero points (asymmetric quantization) are not supported")
            continue
        if scheme.weight_scale_name != "weight_scale" and name.endswith("." + scheme.weight_scale_name):
            name = name[: -len(scheme.weight_scale_name)] + "weight_scale"
        yield name, tensor


def finalize_fp8_checkpoint(model: nn.Module, scheme: Fp8Scheme) -> None:
    """After loading: every weight/input scale must have been set (> 0); attaches the linear method."""
    method = Fp8BlockLinearMethod(scheme.block_size) if scheme.weights == "block" else Fp8LinearMethod()
    for name, layer in fp8_linears(model):
        if layer.weight.dtype != FP8_DTYPE:
            continue
        for pname in ("weight_scale", "input_scale"):
            p = getattr(layer, pname, None)
            if p is not None and not bool((p > 0).all()):
                raise ValueError(f"{name}.{pname}: the checkpoint did not give every packed shard its scale")
        layer.quant_method = method
        if scheme.weights == "block":
            method.warm_up(layer)


# -- parameters and their loaders ---------------------------------------------------------------

def _make_fp8_params(layer: Linear, scheme: Fp8Scheme, name: str) -> None:
    device = layer.weight.device
    out_f, in_f = layer.weight.shape
    weight = nn.Parameter(torch.empty(out_f, in_f, dtype=FP8_DTYPE, device=device), requires_grad=False)
    weight.weight_loader = lambda param, loaded, shard_id=None: _load_weight(layer, name, param, loaded, shard_id)
    layer.weight = weight
    if scheme.weights == "block":
        bn, bk = scheme.block_size
        if in_f % bk:
            raise ValueError(f"{name}: {in_f} input features (this rank) are not a multiple of the block size {bk}")
        shape = (-(-out_f // bn), in_f // bk)
        load = _load_block_scale
    else:
        shape = (1, out_f)
        load = _load_row_scale
    scale = nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=device), requires_grad=False)
    scale.weight_loader = lambda param, loaded, shard_id=None: load(layer, scheme, name, param, loaded, shard_id)
    layer.weight_scale = scale
    if scheme.activations == "static":
        input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device), requires_grad=False)
        input_scale.weight_loader = _load_input_scale
        layer.input_scale = input_scale
    else:
        layer.input_scale = None


def _rows(layer: Linear, shard_id) -> tuple[int, int, int, int]:
    """(first row in the layer's weight, rows on this rank, first row in the checkpoint tensor,
    the checkpoint tensor's rows) of shard `shard_id`."""
    if isinstance(layer, MergedColumnParallelLinear):
        dst, n = layer.shard_offsets[shard_id]
        return dst, n, layer.shard_sources[shard_id], layer.full_sizes[shard_id]
    if isinstance(layer, ColumnParallelLinear):
        n = layer.out_features
        return 0, n, get_tp_rank() * n, layer.full_out
    return 0, layer.out_features, 0, layer.out_features


def _cols(layer: Linear) -> tuple[int, int, int]:
    """(first input column in the checkpoint tensor, columns on this rank, the checkpoint's columns)."""
    if isinstance(layer, RowParallelLinear):
        return get_tp_rank() * layer.in_features, layer.in_features, layer.full_in
    return 0, layer.in_features, layer.in_features


def _load_weight(layer: Linear, name: str, param, loaded: torch.Tensor, shard_id) -> None:
    if loaded.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: the FP8 checkpoint's weight is {loaded.dtype}, expected float8_e4m3fn")
    layer.weight_loader(param, loaded, shard_id)


def _load_row_scale(layer, scheme, name, param, loaded: torch.Tensor, shard_id) -> None:
    dst, n, src, full = _rows(layer, shard_id)
    loaded = loaded.float().reshape(-1)
    if loaded.numel() == 1:  # per tensor: the shard's rows share it
        param.data[0, dst:dst + n] = loaded[0]
    elif loaded.numel() == full:  # per output channel
        param.data[0, dst:dst + n] = loaded[src:src + n]
    else:
        raise ValueError(f"{name} shard {shard_id}: weight_scale has {loaded.numel()} values; expected 1 (per "
                         f"tensor) or {full} (per channel)")


def _load_block_scale(layer, scheme, name, param, loaded: torch.Tensor, shard_id) -> None:
    bn, bk = scheme.block_size
    dst, n, src, full = _rows(layer, shard_id)
    c_src, c_n, c_full = _cols(layer)
    want = (-(-full // bn), -(-c_full // bk))
    if tuple(loaded.shape) != want:
        raise ValueError(f"{name} shard {shard_id}: block weight_scale has shape {tuple(loaded.shape)}, "
                         f"expected {want} for {full} x {c_full} weights in {bn} x {bk} blocks")
    ragged_end = src + n == full and dst + n == layer.out_features  # a partial last block is fine
    if dst % bn or src % bn or (n % bn and not ragged_end) or c_src % bk:
        raise ValueError(f"{name} shard {shard_id}: rows {src}..{src + n} (placed at {dst}) or columns from "
                         f"{c_src} do not start and end on {bn} x {bk} block boundaries; packed shards and "
                         "tensor-parallel slices of block-wise FP8 weights must")
    rb = -(-n // bn)
    rows, cols = slice(src // bn, src // bn + rb), slice(c_src // bk, c_src // bk + c_n // bk)
    param.data[dst // bn: dst // bn + rb] = loaded.float()[rows, cols]


def _load_input_scale(param, loaded: torch.Tensor, shard_id=None) -> None:
    if loaded.numel() != 1:
        raise ValueError(f"input_scale has {loaded.numel()} values; only per-tensor static scales are supported")
    param.data.copy_(torch.maximum(param.data, loaded.float().reshape(1).to(param.device)))
