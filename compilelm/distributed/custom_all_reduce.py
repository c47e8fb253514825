"""The one-shot all-reduce's peer buffers (CUDA, 2..8 ranks of one host).

NCCL's all-reduce has a fixed cost even for the few KB of a decode step. The one-shot kernel
(csrc/cuda/allreduce_kernels.cu) is one launch: every rank stages its rows in a buffer that all
ranks can read (NVLink peer memory), meets its peers at a barrier of flags in those
buffers, and sums every rank's rows itself, with the residual add and the RMSNorm in the same
pass. It reads `world_size` times the data, so it is for small tensors; larger ones, and
anything it does not take, go to NCCL.

It beats NCCL + the norm kernel on a few hundred tokens and loses at decode sizes, where each
call's two barriers (a system-scope CAS on the peer's flag, then a wait) cost more than NCCL's LL
protocol (docs/perf.md, "Tensor parallel all-reduce"); pushing the rows into the peers' buffers
with flags carried in the data (no barrier, one one-way trip) is the known way to win there.

Each rank allocates one buffer of `FLAG_BYTES + max_bytes` and maps every peer's buffer into its
process through CUDA IPC handles (torch's storage sharing, `_share_cuda_`, gathered over the
group; no NVLink multicast), once, lazily on the first call outside CUDA-graph capture: a
collective, so every rank makes it at the same op. Calls inside a capture before that fall back
to NCCL. Graph replays reuse the same buffers and the flags reset themselves, so the kernel is
capturable. `close_custom_all_reduce` drops the buffers when the engine leaves the group.

Not torch symmetric memory: its rendezvous keeps per-process state (the group's store by group
name, a sequence number per exchange) that a second engine in the same process, with fresh
worker processes, no longer shares with its peers, so that engine's rendezvous waited forever
(seen with two TP=2 engines in one pytest process).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor

# Below this the one-shot kernel loses to NCCL (docs/perf.md, "Tensor parallel all-reduce"), so
# smaller tensors go to NCCL until the barrier-free rewrite.
MIN_BYTES = 1 << 20

logger = logging.getLogger(__name__)

MAX_RANKS = 8
FLAG_BYTES = 2 * 128 * MAX_RANKS * 4  # kFlagBytes of allreduce_kernels.cu: uint32 [2][kMaxBlocks][kMaxRanks]
DEFAULT_MAX_BYTES = 8 * 2**20  # the largest x it takes: 512 tokens x 4096 hidden x fp32
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CustomAllReduce:
    """This rank's peer-visible buffer and every peer's address of it."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES,
                 min_bytes: int = MIN_BYTES):
        self.group, self.max_bytes, self.min_bytes = group, max_bytes, min_bytes
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.buffer = torch.zeros(FLAG_BYTES + max_bytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)  # zeroed before a peer can see it
        # (device, IPC handle, size, offset in the allocation, ref counter, its offset, event, sync?)
        shares: list = [None] * self.world_size
        dist.all_gather_object(shares, self.buffer.untyped_storage()._share_cuda_(), group=group)
        # Every rank's buffer in this process, rank order. A peer's is opened on *this* rank's
        # device (cudaIpcOpenMemHandle with lazy peer access from here), not on the peer's as
        # torch.multiprocessing would: mapped there, this rank's kernels may not touch it.
        # Holding the storages keeps the mappings alive.
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.buffers = [self.buffer.untyped_storage() if r == self.rank
                        else torch.UntypedStorage._new_shared_cuda(index, *share[1:])
                        for r, share in enumerate(shares)]
        self.buffer_ptrs = [b.data_ptr() for b in self.buffers]
        dist.barrier(group)  # every rank's flags are zero before any rank signals

    def close(self, peers_present: bool) -> None:
        """Every rank releases its mappings of its peers' buffers before any rank frees the buffer
        its peers mapped: torch parks a shared block that a peer still maps until that peer lets
        go, and a rank that exits with blocks parked may crash at exit (seen: SIGSEGV)."""
        torch.cuda.synchronize(self.buffer.device)
        self.buffers, self.buffer_ptrs = [], []
        if peers_present:
            dist.barrier(self.group)
        self.buffer = None

    def fits(self, *tensors: Tensor) -> bool:
        """The kernel takes x (tensors[0]) and the residual/weight that go with it."""
        x = tensors[0]
        nbytes = x.numel() * x.element_size()
        return (x.dim() == 2 and x.dtype in DTYPES and self.min_bytes <= nbytes <= self.max_bytes
                and x.size(1) * x.element_size() % 16 == 0
                and all(t.is_cuda and t.dtype == x.dtype and t.is_contiguous() and t.data_ptr() % 16 == 0
                        for t in tensors))

    def all_reduce(self, x: Tensor) -> Tensor:
        return torch.ops.compilelm.custom_all_reduce(x, self.buffer_ptrs, self.rank, self.max_bytes)

    def all_reduce_add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        return torch.ops.compilelm.custom_all_reduce_add_rms_norm(x, residual, weight, eps, self.buffer_ptrs,
                                                                  self.rank, self.max_bytes)


_instance: CustomAllReduce | None = None
_unavailable: set[int] = set()  # ids of the groups where it could not be made
_min_bytes: int | None = MIN_BYTES  # this process's engine setting; None = NCCL only


def configure_custom_all_reduce(min_bytes: int | None) -> None:
    """The engine's `custom_all_reduce_min_bytes` (None = MIN_BYTES, -1 = off), before first use."""
    global _min_bytes
    _min_bytes = MIN_BYTES if min_bytes is None else (None if min_bytes < 0 else min_bytes)


def init_custom_all_reduce(device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES,
                           min_bytes: int | None = None) -> CustomAllReduce | None:
    """Makes (or remakes, for another size) this rank's buffer over the whole world; collective.
    None where peer memory is unavailable on some rank (every rank then agrees on NCCL).
    min_bytes None: the configured one (configure_custom_all_reduce)."""
    global _instance
    if min_bytes is None:
        min_bytes = MIN_BYTES if _min_bytes is None else _min_bytes
    group = dist.group.WORLD
    if not 2 <= dist.get_world_size(group) <= MAX_RANKS:
        _unavailable.add(id(group))
        return None
    try:
        car, ok = CustomAllReduce(group, device, max_bytes, min_bytes), 1
    except Exception as exc:  # noqa: BLE001 - no peer memory here: NCCL serves
        logger.warning("one-shot all-reduce unavailable (%s): NCCL all-reduce for every size", exc)
        car, ok = None, 0
    agreed = torch.tensor([ok], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not agreed.item():
        _unavailable.add(id(group))
        car = None
    _instance = car
    return car


def close_custom_all_reduce(peers_present: bool = True) -> None:
    """Drops this rank's buffer and its peers' mappings, before the group is left; collective
    unless `peers_present` is False (a peer is gone)."""
    global _instance
    car, _instance = _instance, None
    _unavailable.clear()
    if car is not None:
        car.close(peers_present)


def get_custom_all_reduce(x: Tensor) -> CustomAllReduce | None:
    """The buffers for x's device, made on first use; None for one rank, CPU tensors, where peer
    memory is unavailable, or inside a CUDA-graph capture before they exist."""
    if not x.is_cuda or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    if _instance is not None and _instance.group is dist.group.WORLD:
        return _instance
    if (_min_bytes is None or id(dist.group.WORLD) in _unavailable
            or torch.cuda.is_current_stream_capturing()):
        return None
    return init_custom_all_reduce(x.device)
