"""Worker: one tensor-parallel rank — its device, its shard of the model, its KV cache and its
ModelRunner (vLLM's Worker). Rank 0 lives in the engine's process; the executor starts the
others in processes of their own, each running `worker_main`.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
import traceback

import torch

from compilelm.config import EngineConfig
from compilelm.distributed.parallel_state import destroy_distributed, init_distributed
from compilelm.distributed.shm_ring import RingHandle
from compilelm.models.loader import build_model, load_model_config, resolve_model
from compilelm.models.registry import get_model_class
from compilelm.ops.device_check import check_cuda_device
from compilelm.runtime import memory
from compilelm.runtime.model_runner import ModelRunner, StepInputs
from compilelm.runtime.step_broadcast import StepReceiver

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None):
        tp = config.tensor_parallel_size
        self.rank = rank
        self.device = config.torch_device()
        if tp > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", rank)
        check_cuda_device(self.device)  # a GPU this build has no kernels for fails here, named
        if tp > 1 and self.device.type == "cpu":  # ranks share the cores
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // tp))
        compilation = config.compilation
        if rank > 0 and compilation is not None and getattr(compilation, "dump_dir", None):
            compilation = dataclasses.replace(compilation, dump_dir=os.path.join(compilation.dump_dir, f"rank{rank}"))
        self.config = dataclasses.replace(config, compilation=compilation)
        init_distributed(rank, tp, init_method, self.device, config.custom_all_reduce_min_bytes)
        self.source = resolve_model(config.model, config.revision, config.download_dir)
        self.model_config = load_model_config(self.source, dict(config.model_overrides))
        self.dtype = config.torch_dtype()
        torch.manual_seed(config.seed)
        if self.device.type == "cuda" and compilation is not None and compilation.level > 0:
            get_model_class(self.model_config)  # the model's imports first: the thread's are disjoint from here on
            threading.Thread(target=_prime_compiler, name="compilelm-prime-compiler", daemon=True).start()
        self.model = build_model(self.source, self.model_config, self.dtype, self.device, config.quantization)
        self.model_runner: ModelRunner | None = None

    def num_kv_blocks(self) -> int:
        """How many KV blocks this rank's memory budget holds (never more than every sequence at
        full length needs, +1 for the null block)."""
        config, cache = self.config, self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = memory.kv_bytes_per_block(self.model_config, cache.block_size,
                                              cache.torch_cache_dtype(self.dtype), config.tensor_parallel_size)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # minus the activations and the CUDA graphs' pool (full + piecewise), allocated after the cache
            budget = (total * cache.gpu_memory_utilization - (total - free)
                      - memory.cuda_memory_reserve(self.model_config, config, self.dtype))
        else:
            budget = cache.kv_cache_memory_gb * 2**30
        needed = config.scheduler.max_num_seqs * -(-config.max_model_len // cache.block_size) + 1
        return max(min(int(budget // per_block), needed), 0)

    def init_model_runner(self, num_blocks: int) -> None:
        """Allocates the KV cache, compiles the model and captures its CUDA graphs."""
        self.model_runner = ModelRunner(self.model, self.config, self.device, num_blocks)

    def release_graphs(self) -> None:
        """Before leaving the process group (see ModelRunner.release_graphs)."""
        if self.model_runner is not None:
            self.model_runner.release_graphs()

    def run_step(self, step: StepInputs) -> None:
        """A rank > 0's part of a step (the logits live on the driver: nothing to return); under
        async scheduling it keeps the step's sampled ids for the next step's pending rows."""
        logits = self.model_runner.run_step(step)
        if step.share_sampled is not None:
            self.model_runner.receive_sampled(step, logits)

    def compile_model(self, profile: list | None = None) -> dict:
        """`compilelm compile`: compile this rank's model without serving; the dump report's data.
        `profile` (StepSpecs, with --dump): then run those steps under the profiler (graphs/profile.py)."""
        from compilelm.graphs import CompiledModel
        from compilelm.graphs.dump import report_data, write_report
        compiled = CompiledModel(self.model, self.config.compilation,
                                 self.config.cache_key_factors(self.model_config))
        compiled.compile()
        if profile:
            from compilelm.graphs.profile import profile_model
            compiled.profile = profile_model(compiled, profile, self.config.cache.block_size,
                                             compiled.dumper.path("profile"))
            write_report(compiled)
        return report_data(compiled)


def _prime_compiler() -> None:
    """While the weights load: import the compiler (Dynamo, Inductor, the passes) and compute
    Triton's source hash, which Inductor's cache keys need even when every piece comes from the
    compile cache. The hash reads and hashes Triton's files (docs/perf.md, "Compile and warm
    start"), work that releases the GIL, as does most of loading weights. The main thread imports
    the same modules later (waiting for this import where it is still running) and redoes
    whatever fails here, raising it there."""
    try:
        import compilelm.graphs.compiler  # noqa: F401, I001  (first: it installs the lazy templates)
        from torch.utils._triton import triton_hash_with_backend  # functools.cache

        triton_hash_with_backend()
    except Exception:  # noqa: BLE001 (the main thread's own attempt reports it)
        logger.debug("priming the compiler failed", exc_info=True)


def worker_main(config: EngineConfig, rank: int, init_method: str, conn, ring: RingHandle) -> None:
    """A rank > 0 process: build the Worker, then run what the driver sends until it goes away.
    Commands come in order from the step ring (runtime/step_broadcast.py), as (method, args,
    want_reply); replies go up `conn`: ("ok", result) or ("error", traceback)."""
    abort = False  # leave the group alone (the driver is gone) instead of with the driver
    worker = receiver = None
    try:
        conn.send(("ok", None))  # started: the driver may now wait in the rendezvous
        receiver = StepReceiver(ring, rank - 1, conn, _driver_alive_check(),
                                spin_s=0.05 if config.torch_device().type == "cuda" else 0.001)
        worker = Worker(config, rank, init_method)
        conn.send(("ok", None))
        while True:
            method, args, want_reply = receiver.recv()
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            if want_reply:
                conn.send(("ok", result))
    except (EOFError, KeyboardInterrupt):  # the driver is gone
        abort = True
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
            if worker is not None and worker.device.type == "cpu":
                # gloo: leaving now closes this rank's connections, so a collective the driver is
                # waiting in fails at once instead of at the group's timeout (an NCCL driver
                # notices while it polls for the step's sampled ids)
                destroy_distributed()
            abort = receiver is None or not _await_shutdown(receiver, conn)
        except OSError:
            abort = True
    finally:
        if worker is not None:
            worker.release_graphs()
        destroy_distributed(abort=abort)
        if receiver is not None:
            receiver.close()


def _driver_alive_check():
    """Raises EOFError once the driver's process is gone (a rank waiting for commands exits)."""
    parent = multiprocessing.parent_process()

    def check() -> None:
        if parent is not None and not parent.is_alive():
            raise EOFError("the tensor-parallel driver exited")
    return check


def _await_shutdown(receiver: StepReceiver, conn) -> bool:
    """After a failure: answer every call with an error until the driver's shutdown (True: the
    driver tears the group down with us) or its exit (False)."""
    try:
        while True:
            method, _, want_reply = receiver.recv()
            if method == "shutdown":
                return True
            if want_reply:
                conn.send(("error", "this rank failed earlier (its traceback was sent then)"))
    except (EOFError, OSError):
        return False
