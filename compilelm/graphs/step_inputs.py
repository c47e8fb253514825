"""A step's inputs: the host arrays a step is built from (`HostBatch`), and the static device
buffers they are copied into in one copy (`InputBuffers`). Every step uses them, on every device,
eager or replayed from a CUDA graph: graphs read fixed addresses, so the buffers' layout depends
only on the step's padded sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from compilelm.forward_context import AttentionMetadata


@dataclass
class HostBatch:
    """One step's inputs on the host, before padding."""

    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    cu_seqlens_q: np.ndarray  # int32 [num_seqs + 1]
    seq_lens: np.ndarray  # int32 [num_seqs]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks_in_batch]; padding -> null block 0
    logits_idx: np.ndarray  # int64 [num_logits_rows]: the rows of the output whose logits are needed
    max_query_len: int


class InputBuffers:
    """Static device tensors for a step's inputs, filled by one host -> device copy per step.

    A step's inputs sit back to back in one int64 buffer (the int32 ones in a region of it viewed
    as int32), packed at offsets that depend only on the step's padded sizes, so a graph replayed
    at its size reads the addresses it captured:

        [input_ids: T][positions: T][slot_mapping: T][int32: cu_seqlens_q S + 1, seq_lens S,
         block_tables S * W][logits_idx: L][pending rows: P][pending src: P]

    (T tokens, S sequences, W block-table width, L logits rows, P pending rows), each field at a
    16-byte aligned offset: Inductor copies a misaligned input of a compiled piece to an aligned
    buffer before every call, a memcpy node per piece in the decode graph (docs/perf.md, "CUDA
    graphs"). It has two pinned host twins used in turn: with async scheduling the host fills
    step N+1's inputs while step N's copy may still be waiting in the stream, so step N+1 writes
    the other twin. Before a twin is rewritten, the event recorded after its last copy is waited
    on (already passed in practice: the engine has waited for step N-1's output by then). One copy
    a step, not one per input: at batch 1 each small copy is GPU time and a launch gap in front of
    the graph.

    input_ids is also where a full graph leaves each row's argmax (its greedy next token): a step
    whose first rows decode exactly those tokens, row for row, copies from past them (`in_place`)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.max_blocks = max_blocks  # block-table width of the captured graphs
        pinned = device.type == "cuda"
        size = 6 * max_tokens + (2 * max_seqs + 2 + max_seqs * max_blocks) // 2 + 16  # (+ the alignment gaps)
        self.hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.copied = [torch.cuda.Event() if pinned else None for _ in self.hosts]  # each twin's last copy
        self.turn = 0

    def load(self, b: HostBatch, num_tokens: int, num_seqs: int, width: int,
             pending: tuple[np.ndarray, np.ndarray] | None = None, in_place: int = 0):
        """Copies `b`, padded to `num_tokens` tokens and `num_seqs` sequences with block tables
        `width` wide (and the pending rows' (rows, src) index arrays), into the buffer, except the
        first `in_place` input ids (already there); returns (input_ids, positions, metadata,
        logits_idx, pending): views of the device buffer, pending = (rows, src) views or None."""
        s, t = len(b.seq_lens), num_tokens
        self.turn ^= 1
        host, copied = self.hosts[self.turn], self.copied[self.turn]
        if copied is not None:
            copied.synchronize()  # its previous copy has left this twin (returns at once if never recorded)
        h64 = host.numpy()
        head = _pack(h64, [(b.input_ids, 0, t), (b.positions, 0, t), (b.slot_mapping, -1, t)], 2)
        start64 = _aligned(head[-1].stop, 2)
        h32 = h64[start64:].view(np.int32)
        views32 = _pack(h32, [(b.cu_seqlens_q, b.cu_seqlens_q[-1], num_seqs + 1), (b.seq_lens, 0, num_seqs)], 4)
        start = _aligned(views32[-1].stop, 4)
        tables = h32[start:start + num_seqs * width].reshape(num_seqs, width)
        tables[:] = 0  # padding: the null block
        tables[:s, :b.block_tables.shape[1]] = b.block_tables
        views32.append(slice(start, start + num_seqs * width))
        rest = [(b.logits_idx, 0, len(b.logits_idx))]
        if pending is not None:
            rest += [(pending[0], 0, len(pending[0])), (pending[1], 0, len(pending[1]))]
        offset = start64 + _aligned(views32[-1].stop, 4) // 2
        tail = [slice(v.start + offset, v.stop + offset) for v in _pack(h64[offset:], rest, 2)]
        dev, end = self.dev, tail[-1].stop
        dev[in_place:end].copy_(host[in_place:end], non_blocking=True)  # queued behind the previous step's work
        if copied is not None:
            copied.record()
        input_ids, positions, slots = (dev[v] for v in head)
        d32 = dev[start64:].view(torch.int32)
        cu, seq_lens, block_tables = (d32[v] for v in views32)
        meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=cu, seq_lens=seq_lens,
                                 block_tables=block_tables.view(num_seqs, width),
                                 max_query_len=b.max_query_len, max_seq_len=int(b.seq_lens.max()))
        pending_views = None if pending is None else (dev[tail[1]], dev[tail[2]])
        return input_ids, positions, meta, dev[tail[0]], pending_views


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _pack(host: np.ndarray, fields, align: int) -> list[slice]:
    """Writes each (values, pad, size) field, padded to size, into `host`, each at the next offset
    that is a multiple of `align` elements; returns the fields' slices."""
    views, offset = [], 0
    for values, pad, size in fields:
        offset = _aligned(offset, align)
        host[offset:offset + len(values)] = values
        host[offset + len(values):offset + size] = pad
        views.append(slice(offset, offset + size))
        offset += size
    return views
