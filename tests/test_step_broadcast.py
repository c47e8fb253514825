"""The tensor-parallel step path on the host: the shared-memory ring (one writer, several reader
processes, slots reused in order, a dead peer raised by `check`, never a hang) and the StepInputs
encoding against the arrays it came from."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest

from compilelm.distributed.shm_ring import ShmRing
from compilelm.graphs.step_inputs import HostBatch
from compilelm.runtime.model_runner import StepInputs
from compilelm.runtime.step_broadcast import decode_step, encode_step, step_bytes


def _reader(handle, reader, count, out_q):
    ring = ShmRing.attach(handle, reader, spin_s=0.001)
    got = []
    for _ in range(count):
        buf = ring.read()
        got.append(bytes(buf))
        del buf
        ring.release()
    ring.close()
    out_q.put((reader, got))


def test_ring_delivers_every_message_in_order_to_every_reader():
    """More messages than slots, of varying sizes: the writer waits for the slowest reader."""
    ctx = multiprocessing.get_context("spawn")
    ring = ShmRing.create(num_readers=2, num_slots=3, slot_bytes=256)
    messages = [bytes([i % 251]) * (1 + (i * 37) % 256) for i in range(40)]
    q = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(ring.handle, r, len(messages), q)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for m in messages:
            ring.write(m)
        results = dict(q.get(timeout=60) for _ in procs)
        assert results == {0: messages, 1: messages}
    finally:
        for p in procs:
            p.join(timeout=30)
        ring.close()


def test_writer_waiting_on_a_dead_reader_raises_through_check():
    ring = ShmRing.create(num_readers=1, num_slots=2, slot_bytes=64, spin_s=0.001, check_s=0.005)
    try:
        ring.write(b"a")
        ring.write(b"b")  # both slots full, nobody reads
        calls = []

        def check():
            calls.append(1)
            if len(calls) >= 3:
                raise RuntimeError("reader 0 exited")
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="exited"):
            ring.write(b"c", check)
        assert time.perf_counter() - t0 < 5
    finally:
        ring.close()


def test_reader_waiting_for_a_dead_writer_raises_through_check():
    ring = ShmRing.create(num_readers=1, num_slots=2, slot_bytes=64)
    reader = ShmRing.attach(ring.handle, 0, spin_s=0.001, check_s=0.005)
    try:
        with pytest.raises(EOFError):
            reader.read(lambda: (_ for _ in ()).throw(EOFError("driver gone")))
        ring.write(b"xyz")
        buf = reader.read()
        assert bytes(buf) == b"xyz"
        del buf
        reader.release()
    finally:
        reader.close()
        ring.close()


def _step(rng, t, s, w, pending: bool) -> StepInputs:
    b = HostBatch(rng.integers(0, 1000, t), rng.integers(0, 5000, t), rng.integers(-1, 9000, t),
                  np.sort(rng.integers(0, t, s + 1)).astype(np.int32), rng.integers(1, 5000, s).astype(np.int32),
                  rng.integers(0, 600, (s, w)).astype(np.int32), rng.integers(0, t, s), 17)
    step = StepInputs(b, "piecewise", 64, s - 1, share_sampled="broadcast")
    if pending:
        step.pending_rows, step.pending_src = rng.integers(0, t, 3), rng.integers(0, s, 3)
    return step


@pytest.mark.parametrize("pending", [False, True])
def test_step_encoding_round_trips(pending):
    rng = np.random.default_rng(0)
    step = _step(rng, 37, 5, 7, pending)
    buf = np.zeros(8192, np.uint8)
    n = encode_step(step, buf)
    assert n == step_bytes(37, 5, 7, 5, 3 if pending else 0)
    got = decode_step(buf[:n])
    buf[:] = 0  # the decoded arrays are copies
    for f in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables", "logits_idx"):
        a, b = getattr(got.batch, f), getattr(step.batch, f)
        assert a.dtype == (np.int32 if f in ("cu_seqlens_q", "seq_lens", "block_tables") else np.int64), f
        np.testing.assert_array_equal(a, b, err_msg=f)
    assert (got.batch.max_query_len, got.graph_mode, got.graph_size, got.num_sampled, got.share_sampled) == \
        (17, "piecewise", 64, 4, "broadcast")
    if pending:
        np.testing.assert_array_equal(got.pending_rows, step.pending_rows)
        np.testing.assert_array_equal(got.pending_src, step.pending_src)
    else:
        assert got.pending_rows is None and got.pending_src is None
    assert encode_step(step, np.zeros(n - 8, np.uint8)) is None  # too large: the caller pipes it
    plain = StepInputs(step.batch, "none", None, 0)
    back = decode_step(buf[:encode_step(plain, buf)])
    assert (back.graph_mode, back.graph_size, back.share_sampled) == ("none", None, None)


def _receiver(handle, conn, count):
    from compilelm.runtime.step_broadcast import StepReceiver
    receiver = StepReceiver(handle, 0, conn, lambda: None, spin_s=0.001)
    for _ in range(count):
        method, args, want_reply = receiver.recv()
        if method == "run_step":
            conn.send((method, args[0].batch.input_ids.tolist(), args[0].batch.block_tables.tolist(), want_reply))
        else:
            conn.send((method, args, None, want_reply))
    receiver.close()


def test_steps_and_calls_arrive_in_order_and_large_steps_go_down_the_pipe():
    """The large step is 4 MiB pickled, far more than a pipe's buffer: its send completes only
    while the rank reads, so the rank must learn it is coming (the marker) before it is sent."""
    import threading

    from compilelm.runtime.step_broadcast import StepBroadcast
    rng = np.random.default_rng(1)
    small, large = _step(rng, 3, 1, 2, True), _step(rng, 400, 16, 1 << 16, False)  # large: > the 2 KiB slot
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    ring = ShmRing.create(num_readers=1, num_slots=2, slot_bytes=2048)
    broadcast = StepBroadcast(ring, [parent], lambda: None)
    proc = ctx.Process(target=_receiver, args=(ring.handle, child, 5))
    proc.start()

    def send():
        broadcast.send_step(small)
        broadcast.send_call("num_kv_blocks", (7,), True)
        broadcast.send_step(large)
        broadcast.send_step(small)
        broadcast.send_call("shutdown", (), False)
    sender = threading.Thread(target=send, daemon=True)  # (a hang here fails the test, below)
    got = []
    try:
        sender.start()
        for _ in range(5):
            assert parent.poll(60), f"the rank got {len(got)} of 5 commands: the sender hangs"
            got.append(parent.recv())
        sender.join(timeout=10)
        assert not sender.is_alive()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        broadcast.close()
    step = lambda s: ("run_step", s.batch.input_ids.tolist(), s.batch.block_tables.tolist(), False)  # noqa: E731
    assert got == [step(small), ("num_kv_blocks", (7,), None, True), step(large), step(small),
                   ("shutdown", (), None, False)]
    assert (broadcast.steps_in_ring, broadcast.steps_piped) == (2, 1)


def test_waiting_for_a_step_checks_the_ranks_and_raises_their_failure():
    """AsyncStepOutput's wait under TP (`_poll`): returns once the event passes, calling the
    check meanwhile; a check that raises (a rank gone) ends the wait with its error."""
    from compilelm.runtime.async_step import _poll

    class Event:  # a torch.cuda.Event stand-in that passes at `at`
        def __init__(self, at):
            self.at = at

        def query(self):
            return time.perf_counter() >= self.at

    calls = []
    _poll(Event(time.perf_counter() + 0.05), lambda: calls.append(1), check_s=0.01)
    assert 2 <= len(calls) <= 6
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        _poll(Event(float("inf")), lambda: (_ for _ in ()).throw(RuntimeError("rank 1 exited")), check_s=0.01)
