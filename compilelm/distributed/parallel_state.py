"""Which rank this process is, in a tensor-parallel group of how many.

One process per rank (started by `compilelm.runtime.executor`). `init_distributed` is called once
per process before the model is built: layers read the rank and size while they allocate their
shards, the way vLLM's `get_tensor_model_parallel_world_size()` works. A process that never calls
it is rank 0 of 1, so single-device code needs no setup.

Backends: gloo for CPU tensors, NCCL for CUDA tensors.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_TP_RANK, _TP_SIZE = 0, 1


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device,
                     custom_all_reduce_min_bytes: int | None = None, timeout_s: float = 600.0) -> None:
    """Joins the process group of all ranks (the whole world is one tensor-parallel group).
    `custom_all_reduce_min_bytes`: see EngineConfig."""
    global _TP_RANK, _TP_SIZE
    if world_size == 1:
        return
    from compilelm.distributed.custom_all_reduce import configure_custom_all_reduce
    configure_custom_all_reduce(custom_all_reduce_min_bytes)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _TP_RANK, _TP_SIZE = rank, world_size
    logger.debug("rank %d of %d joined (%s)", rank, world_size, backend)


def destroy_distributed(abort: bool = False) -> None:
    """Leaves the group: every rank at the same time (NCCL's teardown may wait for its peers),
    after dropping the CUDA graphs that captured the group's collectives (destroying the
    communicator while they live hangs: pytorch/pytorch#115388). With a peer gone, `abort` (NCCL's
    local abort; gloo just destroys)."""
    global _TP_RANK, _TP_SIZE
    from compilelm.distributed.custom_all_reduce import close_custom_all_reduce
    close_custom_all_reduce(peers_present=not abort)
    if dist.is_initialized():
        if abort and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"tensor_parallel_size {denominator} does not divide the model's {what} "
                         f"({numerator})")
    return numerator // denominator


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank caches: an even split, or 1 (replicated) when heads are fewer than ranks."""
    return max(1, num_kv_heads // tp_size)
