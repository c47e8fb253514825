"""The driver's commands to the other tensor-parallel ranks: one ordered stream in a shared-memory
ring (compilelm/distributed/shm_ring.py), each step's `StepInputs` written into it as raw arrays.

A step's inputs are a few small host arrays (HostBatch) and a few scalars. Pickled down a pipe
they cost the driver a pickle and a syscall per rank and the rank a wake-up and an unpickle on
every step; in the ring they are one header of int64s and the arrays' bytes back to back:

    int64 [HEADER]: kind, T, S, W, L, P, max_query_len, graph mode, graph size, num_sampled, share
    int64: input_ids T, positions T, slot_mapping T, logits_idx L, pending_rows P, pending_src P
    int32: cu_seqlens_q S + 1, seq_lens S, block_tables S x W

(P = -1: no pending rows.) Everything else (collective calls, a step too large for a slot,
shutdown) is pickled down the rank's pipe as before, and the ring carries a marker in its place,
so the rank sees one ordered stream. Replies and a rank's failure come back up the pipe.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from compilelm.distributed.shm_ring import RingHandle, ShmRing
from compilelm.graphs.step_inputs import HostBatch
from compilelm.runtime.model_runner import StepInputs

KIND_STEP, KIND_PIPE = 1, 2
HEADER = 11
GRAPH_MODES = ("none", "piecewise", "full")
SHARE_MODES = (None, "argmax", "broadcast")
MAX_SLOT_BYTES = 4 << 20  # larger steps (very long contexts at many sequences) go down the pipe


def step_bytes(num_tokens: int, num_seqs: int, width: int, num_logits: int, num_pending: int) -> int:
    """The encoded size of a step of these sizes."""
    return 8 * (HEADER + 3 * num_tokens + num_logits + 2 * num_pending) + 4 * (2 * num_seqs + 1 + num_seqs * width)


def slot_bytes_for(max_tokens: int, max_seqs: int, max_blocks: int) -> int:
    """A slot that holds the largest step the scheduler can plan (capped at MAX_SLOT_BYTES)."""
    return min(step_bytes(max_tokens, max_seqs, max_blocks, max_tokens, max_seqs), MAX_SLOT_BYTES)


def encode_step(step: StepInputs, out: np.ndarray) -> int | None:
    """Writes `step` into `out` (uint8, 8-byte aligned); its size in bytes, or None if it does not fit."""
    b = step.batch
    t, s, w = len(b.input_ids), len(b.seq_lens), b.block_tables.shape[1]
    lg = len(b.logits_idx)
    p = -1 if step.pending_rows is None else len(step.pending_rows)
    nbytes = step_bytes(t, s, w, lg, max(p, 0))
    if nbytes > len(out):
        return None
    n64 = HEADER + 3 * t + lg + 2 * max(p, 0)
    h = out[:8 * n64].view(np.int64)
    h[:HEADER] = (KIND_STEP, t, s, w, lg, p, b.max_query_len, GRAPH_MODES.index(step.graph_mode),
                  -1 if step.graph_size is None else step.graph_size, step.num_sampled,
                  SHARE_MODES.index(step.share_sampled))
    o = HEADER
    for a in (b.input_ids, b.positions, b.slot_mapping, b.logits_idx,
              *(() if p < 0 else (step.pending_rows, step.pending_src))):
        h[o:o + len(a)] = a
        o += len(a)
    i32 = out[8 * n64:nbytes].view(np.int32)
    i32[:s + 1] = b.cu_seqlens_q
    i32[s + 1:2 * s + 1] = b.seq_lens
    i32[2 * s + 1:].reshape(s, w)[:] = b.block_tables
    return nbytes


def decode_step(buf: np.ndarray) -> StepInputs:
    """The StepInputs `encode_step` wrote into `buf` (copies: the slot is reused later)."""
    kind, t, s, w, lg, p, max_query_len, mode, size, num_sampled, share = buf[:8 * HEADER].view(np.int64).tolist()
    if kind != KIND_STEP:
        raise ValueError(f"not an encoded step (kind {kind})")
    n = max(p, 0)
    n64 = HEADER + 3 * t + lg + 2 * n
    a64 = buf[:8 * n64].view(np.int64).copy()  # one copy out of the slot; the arrays are views of it
    a32 = buf[8 * n64:8 * n64 + 4 * (2 * s + 1 + s * w)].view(np.int32).copy()
    o = HEADER + 3 * t
    rows, src = a64[o + lg:o + lg + n], a64[o + lg + n:o + lg + 2 * n]
    batch = HostBatch(a64[HEADER:HEADER + t], a64[HEADER + t:HEADER + 2 * t], a64[HEADER + 2 * t:o],
                      a32[:s + 1], a32[s + 1:2 * s + 1], a32[2 * s + 1:].reshape(s, w), a64[o:o + lg], max_query_len)
    return StepInputs(batch, GRAPH_MODES[mode], None if size < 0 else size, num_sampled,
                      None if p < 0 else rows, None if p < 0 else src, SHARE_MODES[share])


class StepBroadcast:
    """The driver's end: a ring with a reader per other rank, and each rank's pipe.
    `check()` raises when a rank failed or exited (called while a write waits for a slot)."""

    def __init__(self, ring: ShmRing, conns: list, check: Callable[[], None]):
        self.ring, self.conns, self.check = ring, conns, check
        self.steps_in_ring = self.steps_piped = 0

    def send_step(self, step: StepInputs) -> None:
        slot = self.ring.reserve(self.check)
        nbytes = encode_step(step, slot)
        if nbytes is None:  # too large for a slot: pickled, in order with the rest
            self.steps_piped += 1
            self._pipe(("run_step", (step,), False), slot)
            return
        self.steps_in_ring += 1
        self.ring.publish(nbytes)

    def send_call(self, method: str, args: tuple, want_reply: bool,
                  check: Callable[[], None] | None = None) -> None:
        self._pipe((method, args, want_reply), self.ring.reserve(check or self.check))

    def _pipe(self, message, slot: np.ndarray) -> None:
        # The marker first: a rank reads its pipe only once it has seen it, and a message larger
        # than the pipe's buffer (an oversized step) blocks `send` until the rank reads.
        slot[:8].view(np.int64)[0] = KIND_PIPE
        self.ring.publish(8)
        error = None
        for conn in self.conns:  # every live rank gets it, even when one's pipe is broken
            try:
                conn.send(message)
            except OSError as exc:
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        self.ring.close()


class StepReceiver:
    """A rank's end: `recv()` is the driver's next command, (method, args, want_reply), from the
    ring or, where the ring says so, the pipe. `check()` raises EOFError when the driver is gone."""

    def __init__(self, handle: RingHandle, reader: int, conn, check: Callable[[], None], spin_s: float):
        self.ring = ShmRing.attach(handle, reader, spin_s=spin_s)
        self.conn, self.check = conn, check

    def recv(self) -> tuple[str, tuple, bool]:
        buf = self.ring.read(self.check)
        try:
            kind = int(buf[:8].view(np.int64)[0])
            if kind == KIND_STEP:
                return "run_step", (decode_step(buf),), False
            if kind != KIND_PIPE:
                raise RuntimeError(f"corrupt tensor-parallel command ring (message kind {kind})")
        finally:
            del buf
            self.ring.release()
        return self.conn.recv()

    def close(self) -> None:
        self.ring.close()
