"""Token embedding and LM head split over the vocabulary (vLLM's VocabParallelEmbedding).

Rank r holds rows [r * n, (r + 1) * n) of the [vocab, hidden] table, n = ceil(vocab / tp); the
last rank's rows past the vocabulary are zero padding. The embedding looks up the ids it owns,
writes zeros for the others, and an all-reduce sums the ranks' rows. The LM head multiplies by
its rows and an all-gather concatenates the logits (padding columns dropped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compilelm.distributed.parallel_state import get_tp_rank, get_tp_size
from compilelm.ops.collectives import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        tp = get_tp_size()
        self.num_embeddings = num_embeddings
        self.rows = -(-num_embeddings // tp)  # rows on each rank
        self.start = get_tp_rank() * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, embedding_dim]
        if get_tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(local.masked_fill(~mine, 0), self.weight)
        return tensor_model_parallel_all_reduce(x.masked_fill(~mine.unsqueeze(-1), 0))

    def full_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        return (self.num_embeddings, param.shape[1])

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != self.full_shape(param):
            raise ValueError(f"weight shape mismatch: embedding {self.full_shape(param)} vs checkpoint "
                             f"{tuple(loaded.shape)}")
        n = min(self.rows, self.num_embeddings - self.start)
        param.data[:n].copy_(loaded[self.start:self.start + n])
        param.data[n:].zero_()

    def load_full(self, param: torch.Tensor, full: torch.Tensor) -> None:
        self.weight_loader(param, full)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; also used through an embedding's weight when they are tied."""


def compute_logits(hidden: torch.Tensor, head: VocabParallelEmbedding, out: torch.Tensor | None = None,
                   argmax_out: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head's logits in the model dtype, written into `out` if given (a full decode graph's
    static buffer, which the GEMM writes directly), and with `argmax_out` (int64 [n], needs `out`)
    each row's argmax too: greedy sampling inside the graph, fused into the LM head's kernel at 1-2
    rows. The sampler converts the logits to fp32 where it needs to."""
    # hidden: [n, hidden] -> logits [n, vocab]
    if out is not None and get_tp_size() == 1 and hidden.dim() == 2:  # as below, into out
        if argmax_out is None:
            torch.ops.compilelm.linear_out.default(hidden, head.weight, out)
        else:
            torch.ops.compilelm.linear_argmax_out.default(hidden, head.weight, out, argmax_out)
        return out
    if hidden.is_cuda and hidden.dim() == 2:  # at 1-2 rows the weight-streaming kernel, else cuBLAS
        logits = torch.ops.compilelm.linear.default(hidden, head.weight)
    else:
        logits = F.linear(hidden, head.weight)
    if get_tp_size() > 1:
        logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, :head.num_embeddings]
    if out is None:
        return logits
    out.copy_(logits)
    if argmax_out is not None:
        argmax_out.copy_(torch.ops.compilelm.argmax_rows.default(out))
    return out
