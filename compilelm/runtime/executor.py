"""Executor: runs the model on `tensor_parallel_size` ranks, one process per rank.

This process is rank 0, the driver: it owns the scheduler (in the engine) and samples. For
tp > 1 the executor spawns ranks 1..tp-1 (`worker_main`), each building its shard of the model.
Every step the driver writes the step's host arrays (`StepInputs`) into a shared-memory ring that
every rank reads (runtime/step_broadcast.py; calls and shutdown are pickled down each rank's pipe,
in order with the steps) and then runs the same forward itself; the collectives inside the
forward (all-reduce after each row-parallel linear, all-gather of the vocab-parallel logits) keep
the ranks in lock step. Only the driver gets logits back and samples. With async scheduling the
driver returns as soon as the step is launched; the ranks keep its sampled ids on their devices
(`ModelRunner.receive_sampled`). A rank that fails sends its traceback up its pipe, which the
driver raises (checked after each step, while waiting for a ring slot and for sampled ids); a
rank that exits is an error too.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import weakref

from compilelm.config import EngineConfig
from compilelm.distributed.parallel_state import destroy_distributed
from compilelm.distributed.shm_ring import ShmRing
from compilelm.runtime.async_step import AsyncStepOutput
from compilelm.runtime.model_runner import StepInputs, StepOutput
from compilelm.runtime.scheduler import SchedulerOutput
from compilelm.runtime.step_broadcast import StepBroadcast, slot_bytes_for
from compilelm.runtime.worker import Worker, worker_main

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Executor:
    def __init__(self, config: EngineConfig):
        tp = config.tensor_parallel_size
        self.procs, self.conns = [], []
        init_method = f"tcp://127.0.0.1:{_free_port()}" if tp > 1 else None
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked CUDA or threads
        self.broadcast = None
        # Steps get no reply: a rank that sent something has failed (or exited). Raises then.
        self._check_failures = _rank_check(self.procs, self.conns)
        if tp > 1:
            sched, slot_bytes = config.scheduler, 1 << 20  # (no scheduler: `compile`, which runs no step)
            if sched is not None and config.max_model_len:
                slot_bytes = slot_bytes_for(sched.max_num_batched_tokens, sched.max_num_seqs,
                                            -(-config.max_model_len // config.cache.block_size))
            ring = ShmRing.create(tp - 1, num_slots=4, slot_bytes=slot_bytes)
            self.broadcast = StepBroadcast(ring, self.conns, self._check_failures)
        for rank in range(1, tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(config, rank, init_method, child, ring.handle),
                               name=f"compilelm-tp-rank{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        # Stops the ranks when this executor is collected or at exit (holds no reference to self,
        # and only a weak one to the driver: an engine dropped by its user frees its model and KV
        # cache).
        self._driver_ref: list = []  # [weakref to self.driver], once it is built
        self._finalizer = weakref.finalize(self, _stop_ranks, self.procs, self.conns, self.broadcast,
                                           self._driver_ref)
        try:
            self._wait_started()
            self.driver = Worker(config, 0, init_method)  # joins the group once every rank is up
            self._driver_ref.append(weakref.ref(self.driver))
            self._replies()  # every rank built its model
        except BaseException:
            self.shutdown()
            raise
        if tp > 1:
            logger.info("tensor parallel: %d ranks (%s)", tp, self.driver.device.type)

    # -- calls on every rank ---------------------------------------------------------------------

    def collective_rpc(self, method: str, *args) -> list:
        """Runs `Worker.<method>(*args)` on every rank; returns the results in rank order."""
        if self.broadcast is not None:
            self.broadcast.send_call(method, args, True)
        result = getattr(self.driver, method)(*args)
        return [result, *self._replies()]

    def _replies(self) -> list:
        return [self._reply(rank) for rank in range(1, len(self.conns) + 1)]

    def _reply(self, rank: int):
        """The next message from `rank`: its result, or its failure raised here."""
        try:
            status, value = self.conns[rank - 1].recv()
        except EOFError:
            raise RuntimeError(f"tensor-parallel rank {rank} exited "
                               f"(exit code {self.procs[rank - 1].exitcode})") from None
        if status == "error":
            raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{value}")
        return value

    def _wait_started(self) -> None:
        """Every rank's process is running (else the rendezvous would wait for it until its timeout)."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if not proc.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited while starting (exit code {proc.exitcode}); "
                        "a script that starts tensor-parallel engines must guard its entry point with "
                        "`if __name__ == '__main__':` (ranks are spawned)")
        self._replies()

    # -- the engine's interface --------------------------------------------------------------------

    def num_kv_blocks(self) -> int:
        return min(self.collective_rpc("num_kv_blocks"))

    def init_model_runner(self, num_blocks: int) -> None:
        self.collective_rpc("init_model_runner", num_blocks)

    @property
    def model_runner(self):
        return self.driver.model_runner

    def execute_model(self, sched: SchedulerOutput) -> StepOutput:
        runner = self.driver.model_runner
        if self.broadcast is None:
            return runner.execute_model(sched)
        step = runner.prepare_step(sched)
        logits = self._run_step(step)
        # sampled as an async step is, then waited for at once: on CUDA the wait polls the ranks,
        # whose failure or exit would otherwise leave it in a blocking copy behind a collective
        # that never completes
        return self.sample_async(sched, step, logits).get()

    def _run_step(self, step: StepInputs):
        """Every rank runs `step`: the others from the ring, then this one; its logits."""
        self.broadcast.send_step(step)
        try:
            return self.driver.model_runner.run_step(step)
        finally:
            self._check_failures()

    def execute_model_async(self, sched: SchedulerOutput, step: StepInputs | None = None) -> AsyncStepOutput:
        """Launches the step without waiting for its tokens (async scheduling); `step`: its
        `prepare_step`, if already made."""
        if self.broadcast is None:
            return self.driver.model_runner.execute_model_async(sched, step)
        return self.sample_async(sched, *self.launch_forward(sched, step))

    def prepare_step(self, sched: SchedulerOutput, after: SchedulerOutput | None = None) -> StepInputs:
        """Rank 0's ModelRunner.prepare_step for an async step (host arrays only; see there for
        `after`)."""
        return self.driver.model_runner.prepare_step(sched, share_sampled=self.broadcast is not None, after=after)

    def launch_forward(self, sched: SchedulerOutput, step: StepInputs | None = None):
        """ModelRunner.launch_forward on every rank; (rank 0's StepInputs, its logits)."""
        step = step if step is not None else self.prepare_step(sched)
        if self.broadcast is None:
            return self.driver.model_runner.launch_forward(sched, step)
        return step, self._run_step(step)

    def sample_async(self, sched: SchedulerOutput, step, logits, masks=None) -> AsyncStepOutput:
        check = None if self.broadcast is None else self._check_failures
        return self.driver.model_runner.sample_async(sched, step, logits, masks, check)

    def shutdown(self) -> None:
        self._finalizer()


def _rank_check(procs: list, conns: list):
    """A function that raises when a rank has failed (its traceback is waiting on its pipe) or
    exited. Between calls that want a reply, a rank sends nothing unless it failed."""
    def check() -> None:
        for rank, (proc, conn) in enumerate(zip(procs, conns), start=1):
            if conn.poll():
                try:
                    status, value = conn.recv()
                except EOFError:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (exit code {proc.exitcode})") from None
                if status == "error":
                    raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{value}")
                raise RuntimeError(f"tensor-parallel rank {rank} sent an unexpected reply")
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (exit code {proc.exitcode})")
    return check


def _exited_check(procs: list):
    def check() -> None:
        if not all(proc.is_alive() for proc in procs):
            raise RuntimeError("a tensor-parallel rank exited")
    return check


def _stop_ranks(procs: list, conns: list, broadcast: StepBroadcast | None, driver_ref: list) -> None:
    """Executor.shutdown, also run when the executor is collected or at interpreter exit."""
    if not procs:  # one rank: no processes, no process group
        if broadcast is not None:
            broadcast.close()
        return
    driver = driver_ref[0]() if driver_ref else None
    if driver is not None:  # its graphs go before the group does (every rank does the same): an
        driver.release_graphs()  # NCCL group left under graphs that captured it hangs
    del driver
    all_alive = all(proc.is_alive() for proc in procs)
    try:  # (a failed rank waits for this message: only an exited one makes the send give up)
        broadcast.send_call("shutdown", (), False, check=_exited_check(procs))
    except (OSError, RuntimeError):  # a rank is gone: it needs no message
        pass
    # every rank leaves the group now, together (NCCL's teardown may wait for its peers); with a
    # rank already gone, this one aborts alone
    destroy_distributed(abort=not all_alive)
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()
    broadcast.close()
