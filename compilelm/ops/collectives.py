"""The collectives a tensor-parallel model calls, as functional custom ops.

`compilelm::all_reduce` is one opaque op in the traced graph (Dynamo does not look inside), so
the whole-graph pass `AllReduceRMSNormFusionPass` can find `all_reduce -> add -> rms_norm` and
replace it with `compilelm::fused_allreduce_add_rms_norm`. On CPU that op is the all-reduce
followed by the add+norm (same numerics as the unfused graph). On CUDA both ops run the one-shot
all-reduce over peer memory (`custom_all_reduce.py`; the fused op with the add and the norm in
its epilogue) when the tensor fits its buffer, else NCCL (+ the fused add+RMSNorm kernel).

`tensor_model_parallel_all_gather` is called outside the compiled graph (the vocab-parallel LM
head), eagerly. The peer buffers of the one-shot kernels are a process resource, managed in
compilelm/distributed/custom_all_reduce.py (whose kernels this package's library loads).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from compilelm.distributed.custom_all_reduce import get_custom_all_reduce
from compilelm.distributed.parallel_state import get_tp_size
from compilelm.ops.norm import fused_add_rms_norm_ref

_tracing_patterns = False


@contextlib.contextmanager
def tracing_patterns():
    """While a fusion pass traces its patterns on small real example tensors (one rank at a time,
    whenever its pass manager is built), all_reduce is the identity: only the graph's shape
    matters, and a collective there would need every rank to trace in step (and, under NCCL,
    cannot take the CPU examples at all)."""
    global _tracing_patterns
    prev, _tracing_patterns = _tracing_patterns, True
    try:
        yield
    finally:
        _tracing_patterns = prev


def _reduces() -> bool:
    return get_tp_size() > 1 and not _tracing_patterns


@torch.library.custom_op("compilelm::all_reduce", mutates_args=())
def all_reduce(x: Tensor) -> Tensor:
    """Sum of `x` over the tensor-parallel group (a new tensor; `x` is untouched)."""
    out = x.clone()
    if _reduces():
        dist.all_reduce(out)
    return out


@all_reduce.register_kernel("cuda")
def _(x):
    car = get_custom_all_reduce(x)
    if car is not None and car.fits(x):
        return car.all_reduce(x)
    out = x.clone()
    if _reduces():
        dist.all_reduce(out)
    return out


@all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("compilelm::fused_allreduce_add_rms_norm", mutates_args=())
def fused_allreduce_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual = all_reduce(x) + residual; returns (rms_norm(residual), residual).
    x, residual: [num_tokens, hidden]; weight: [hidden]."""
    return fused_add_rms_norm_ref(all_reduce(x), residual, weight, eps)


@fused_allreduce_add_rms_norm.register_kernel("cuda")
def _(x, residual, weight, eps):
    car = get_custom_all_reduce(x)
    if car is not None and car.fits(x, residual, weight):
        return car.all_reduce_add_rms_norm(x, residual, weight, eps)
    total = all_reduce(x)
    if weight.dtype == x.dtype:
        return tuple(torch.ops.compilelm.fused_add_rms_norm(total, residual, weight, eps))
    return fused_add_rms_norm_ref(total, residual, weight, eps)


@fused_allreduce_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def tensor_model_parallel_all_reduce(x: Tensor) -> Tensor:
    return torch.ops.compilelm.all_reduce(x) if get_tp_size() > 1 else x


def tensor_model_parallel_all_gather(x: Tensor, dim: int = -1) -> Tensor:
    """Concatenates every rank's `x` along `dim` (rank order)."""
    world = get_tp_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_broadcast(x: Tensor, src: int = 0) -> Tensor:
    """Every rank's `x` (contiguous, the same shape and dtype on every rank) takes rank `src`'s
    values, in place; on CUDA queued on the stream (the host does not wait)."""
    if get_tp_size() > 1:
        dist.broadcast(x, src)
    return x
