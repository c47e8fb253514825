"""Tensor parallelism: process groups, the collectives the model calls, and their fused forms."""

from compilelm.distributed.parallel_state import (  # noqa: F401
    destroy_distributed,
    get_tp_rank,
    get_tp_size,
    init_distributed,
)
