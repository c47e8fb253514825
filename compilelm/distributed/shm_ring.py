"""A shared-memory ring: one writer process, a fixed set of reader processes, messages of bytes.

The tensor-parallel driver sends each step's inputs to the other ranks through it instead of
pickling them down a pipe: a write is a memcpy into a slot and one store of its sequence number;
a read waits for that number, then the bytes are there (docs/perf.md, "Tensor parallel host
path"). Layout of the one segment (counters int64, each alone on a 64-byte cache line):

    [seq of each slot: num_slots lines][ack of each reader: num_readers lines]
    [nbytes of each slot: num_slots lines][slot 0 payload: slot_bytes]...[slot num_slots-1 payload]

Message m (1, 2, ...) goes to slot m % num_slots. The writer waits until every reader has
acknowledged message m - num_slots (the slot is free), writes the payload and its length, then
publishes seq[slot] = m. Reader r waits for seq[slot] == m, reads, then stores ack[r] = m. Stores
are ordered by a fence (a lock round trip: a full barrier on every CPU), so a reader that sees
the sequence number sees the payload.

Waiting spins (yielding the CPU between polls) for `spin_s`, then sleeps `sleep_s` per poll;
every `check_s` it calls the caller's `check()`, which raises when the peer died or failed: a
dead peer is an error, never a hang.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

_LINE = 8  # int64s per 64-byte cache line
_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (acquire + release of a lock)."""
    with _fence_lock:
        pass


@dataclass(frozen=True)
class RingHandle:
    """What a reader process needs to attach (picklable)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int


class ShmRing:
    """See the module docstring. `create` in the writer; `attach(handle, reader)` in each reader."""

    def __init__(self, shm: shared_memory.SharedMemory, handle: RingHandle, reader: int | None,
                 spin_s: float, sleep_s: float, check_s: float):
        self.shm, self.handle, self.reader = shm, handle, reader
        self.spin_s, self.sleep_s, self.check_s = spin_s, sleep_s, check_s
        n, r = handle.num_slots, handle.num_readers
        ints = (2 * n + r) * _LINE
        counters = np.ndarray((ints,), np.int64, buffer=shm.buf)
        self._seq = counters[:n * _LINE:_LINE]  # seq[slot]: the message the slot holds (0: none)
        self._acks = counters[n * _LINE:(n + r) * _LINE:_LINE]  # ack[reader]: its last message read
        self._nbytes = counters[(n + r) * _LINE::_LINE]  # nbytes[slot]
        self._data = np.ndarray((n, handle.slot_bytes), np.uint8, buffer=shm.buf, offset=ints * 8)
        self.next = 1  # the next message to write (writer) or read (reader)

    @staticmethod
    def segment_bytes(num_readers: int, num_slots: int, slot_bytes: int) -> int:
        return (2 * num_slots + num_readers) * _LINE * 8 + num_slots * slot_bytes

    @classmethod
    def create(cls, num_readers: int, num_slots: int, slot_bytes: int, spin_s: float = 0.05,
               sleep_s: float = 1e-4, check_s: float = 0.01) -> ShmRing:
        if num_readers < 1 or num_slots < 2 or slot_bytes < 64:
            raise ValueError(f"ShmRing needs readers >= 1, slots >= 2, slot_bytes >= 64 "
                             f"(got {num_readers}, {num_slots}, {slot_bytes})")
        slot_bytes = -(-slot_bytes // 64) * 64
        shm = shared_memory.SharedMemory(create=True, size=cls.segment_bytes(num_readers, num_slots, slot_bytes))
        shm.buf[:(2 * num_slots + num_readers) * _LINE * 8] = bytes((2 * num_slots + num_readers) * _LINE * 8)
        return cls(shm, RingHandle(shm.name, num_readers, num_slots, slot_bytes), None, spin_s, sleep_s, check_s)

    @classmethod
    def attach(cls, handle: RingHandle, reader: int, spin_s: float = 0.05, sleep_s: float = 1e-4,
               check_s: float = 0.01) -> ShmRing:
        """Reader `reader` (0-based) of the ring `handle` names. The writer owns the segment: a
        reader neither registers it with the resource tracker nor unlinks it."""
        if not 0 <= reader < handle.num_readers:
            raise ValueError(f"reader {reader} outside 0..{handle.num_readers - 1}")
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None  # (Python < 3.13 has no track=False)
        try:
            shm = shared_memory.SharedMemory(name=handle.name)
        finally:
            resource_tracker.register = register
        return cls(shm, handle, reader, spin_s, sleep_s, check_s)

    @property
    def slot_bytes(self) -> int:
        return self.handle.slot_bytes

    # -- writer ------------------------------------------------------------------------------------

    def reserve(self, check: Callable[[], None] | None = None) -> np.ndarray:
        """The next message's slot (uint8 [slot_bytes], writable), once every reader is done with
        it; fill it, then `publish(nbytes)`."""
        m, slot = self.next, self.next % self.handle.num_slots
        if m > self.handle.num_slots:
            self._wait(lambda: int(self._acks.min()) >= m - self.handle.num_slots, check)
            _fence()  # the readers' loads of the old payload before our stores
        return self._data[slot]

    def publish(self, nbytes: int) -> None:
        if not 0 <= nbytes <= self.handle.slot_bytes:
            raise ValueError(f"message of {nbytes} bytes in slots of {self.handle.slot_bytes}")
        slot = self.next % self.handle.num_slots
        self._nbytes[slot] = nbytes
        _fence()  # payload and length before the sequence number
        self._seq[slot] = self.next
        self.next += 1

    def write(self, payload: bytes, check: Callable[[], None] | None = None) -> None:
        view = self.reserve(check)
        view[:len(payload)] = np.frombuffer(payload, np.uint8)
        self.publish(len(payload))

    # -- reader ------------------------------------------------------------------------------------

    def read(self, check: Callable[[], None] | None = None) -> np.ndarray:
        """The next message's bytes (a view into the slot, valid until `release()`)."""
        m, slot = self.next, self.next % self.handle.num_slots
        seq = self._seq
        if seq[slot] != m:
            self._wait(lambda: seq[slot] == m, check)
        _fence()  # the sequence number before the payload
        return self._data[slot, :int(self._nbytes[slot])]

    def release(self) -> None:
        """Done with the message `read` returned: its slot may be rewritten."""
        _fence()
        self._acks[self.reader] = self.next
        self.next += 1

    # -- both --------------------------------------------------------------------------------------

    def _wait(self, ready: Callable[[], bool], check: Callable[[], None] | None) -> None:
        start = last_check = time.perf_counter()
        while not ready():
            now = time.perf_counter()
            if check is not None and now - last_check >= self.check_s:
                check()
                last_check = now
            if now - start < self.spin_s:
                os.sched_yield()
            else:
                time.sleep(self.sleep_s)

    def close(self) -> None:
        """Drops this process's mapping (the views first: the segment refuses to close under
        them); the writer, which owns the segment, also removes its name. Idempotent."""
        self._seq = self._acks = self._nbytes = self._data = None
        shm, self.shm = self.shm, None
        if shm is None:
            return
        try:
            shm.close()
        except BufferError:  # a caller still holds a view of a slot: the mapping goes at exit
            pass
        if self.reader is None:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
