"""Host time of decode steps, async scheduling on vs off, on one engine (CUDA; CPU runs too).

`batch` requests with random `context`-token prompts decode; for each mode the median wall time
of `engine.step()` is taken over `--steps` steps; `--profile-steps` more run with each part of the
step timed (PHASES: schedule, prepare_step, run_step, _sample, _process_step), and as many again
under cProfile, whose functions with the most own time are printed. With async scheduling a step costs
max(host, GPU) instead of host + GPU, so the gap between the two medians is the host time hidden
behind the GPU. Past results: docs/perf.md, "Host overhead and async scheduling".

With `--tensor-parallel-size N` the driver's write of each step into the other ranks' ring is a
phase of its own, and a transport benchmark follows: a decode step of this engine's shape sent
`--transport-steps` times to one spawned reader, pickled down a pipe (the old path) and through
the shared-memory ring, timing the sender's cost and the one-way latency until the reader holds
the decoded arrays (docs/perf.md, "Tensor parallel host path").

    python benchmarks/profile_host.py [--model dummy:smollm2-135m] [--batch 64] [--context 1024]
        [--tensor-parallel-size 2] [--model-overrides '{"num_hidden_layers": 2}'] [--modes async sync]
    python benchmarks/profile_host.py --transport-only [--batch 64] [--context 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_decode import prompts  # noqa: E402
from benchmarks.common import time_calls, write_result  # noqa: E402


def measure(engine, async_scheduling: bool, args) -> dict:
    from compilelm import SamplingParams

    while engine.has_unfinished_requests():  # nothing in flight: the loop may switch modes
        engine.step()
    engine.async_scheduling = async_scheduling
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + args.profile_steps + 32, ignore_eos=True)
    ids = [engine.add_request(None, p, params)
           for p in prompts(args.batch, args.context, engine.model_config.vocab_size, args.batch)]
    for _ in range(10):  # prefill, then decodes in flight
        engine.step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    totals: dict[str, float] = {}
    with phase_timers(engine, totals):
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            engine.step()
        totals["step (all of it)"] = time.perf_counter() - t0
    phases_ms = {k: v * 1e3 / args.profile_steps for k, v in totals.items()}
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.profile_steps):
        engine.step()
    prof.disable()
    engine.abort_request(ids)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    return dict(async_scheduling=async_scheduling, median_ms=statistics.median(times) * 1e3,
                phases_ms=phases_ms, profile_top=text.getvalue().splitlines()[6:34])


# The parts of a step, (engine attribute, method): the host's own work. The rest of a step's wall
# time is launch glue and, with async scheduling, waiting for the GPU.
PHASES = (("scheduler", "schedule"), ("model_runner", "prepare_step"), ("model_runner", "run_step"),
          ("model_runner", "_sample"), ("", "_process_step"))


TP_PHASES = (("executor.broadcast", "send_step"),)  # tensor_parallel_size > 1


@contextlib.contextmanager
def phase_timers(engine, totals: dict[str, float]):
    """Sums the wall time of each PHASES method into `totals` (seconds), wrapping it on its instance."""
    patched = []
    phases = PHASES + (TP_PHASES if engine.executor.broadcast is not None else ())
    for owner_name, method in phases:
        owner = engine
        for part in owner_name.split(".") if owner_name else ():
            owner = getattr(owner, part)
        time_calls(owner, method, totals, f"{owner_name or 'engine'}.{method}")
        patched.append((owner, method))
    try:
        yield
    finally:
        for owner, method in patched:
            delattr(owner, method)  # the class's method again


# -- the step transport alone: pickled pipe vs shared-memory ring ---------------------------------

def _transport_reader(conn, handle, n: int) -> None:
    """Says it is ready (its imports done), receives n steps by pipe, then n by ring; sends back
    each arrival time (perf_counter: CLOCK_MONOTONIC, one clock for every process of the machine)."""
    from compilelm.runtime.step_broadcast import StepReceiver
    conn.send("ready")
    arrivals = []
    for _ in range(n):
        conn.recv()
        arrivals.append(time.perf_counter())
    receiver = StepReceiver(handle, 0, conn, lambda: None, spin_s=1.0)
    for _ in range(n):
        receiver.recv()
        arrivals.append(time.perf_counter())
    receiver.close()
    conn.send(arrivals)


def transport(step, n: int) -> dict:
    """Sender cost and one-way latency (median, microseconds) of `step` by pipe and by ring. The
    sender paces the steps 2 ms apart (as decode steps are), so no send queues behind another."""
    import multiprocessing
    import pickle

    import numpy as np

    from compilelm.distributed.shm_ring import ShmRing
    from compilelm.runtime.step_broadcast import StepBroadcast, encode_step, slot_bytes_for
    b = step.batch
    ring = ShmRing.create(1, 4, max(slot_bytes_for(len(b.input_ids), len(b.seq_lens), b.block_tables.shape[1]), 4096))
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_transport_reader, args=(child, ring.handle, n))
    proc.start()
    if not parent.poll(300) or parent.recv() != "ready":  # (a late reader would time its start-up)
        raise RuntimeError("the transport benchmark's reader did not start")
    broadcast = StepBroadcast(ring, [parent], lambda: None)
    sent, cost = [], []
    for send in (lambda: parent.send(("run_step", (step,), False)), lambda: broadcast.send_step(step)):
        for _ in range(n):
            t0 = time.perf_counter()
            send()
            sent.append(t0)
            cost.append(time.perf_counter() - t0)
            time.sleep(max(0.0, 2e-3 - (time.perf_counter() - t0)))
    arrivals = parent.recv()
    proc.join(timeout=30)
    ring.close()
    med = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    lat = [a - s for a, s in zip(arrivals, sent)]
    return {"pickled_bytes": len(pickle.dumps(step)), "ring_bytes": encode_step(step, np.zeros(1 << 24, np.uint8)),
            "pipe_send_us": med(cost[:n]), "pipe_latency_us": med(lat[:n]),
            "ring_send_us": med(cost[n:]), "ring_latency_us": med(lat[n:])}


def synthetic_decode_step(batch: int, context: int, block_size: int = 16):
    """A pure-decode step's inputs: `batch` sequences at `context` tokens (for --transport-only)."""
    import numpy as np

    from compilelm.graphs.step_inputs import HostBatch
    from compilelm.runtime.model_runner import StepInputs
    blocks = -(-context // block_size)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks) + 1
    positions = np.full(batch, context - 1, np.int64)
    rows = np.arange(batch, dtype=np.int64)
    b = HostBatch(rows + 7, positions, tables[:, -1].astype(np.int64) * block_size + (context - 1) % block_size,
                  np.arange(batch + 1, dtype=np.int32), np.full(batch, context, np.int32), tables, rows, 1)
    return StepInputs(b, "full", batch, batch, rows, rows, "argmax")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--model-overrides", type=json.loads, default=None, help="JSON (e.g. fewer layers)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", nargs="+", choices=("async", "sync"), default=["async", "sync"])
    ap.add_argument("--transport-steps", type=int, default=200, help="0: no transport benchmark (TP only)")
    ap.add_argument("--transport-only", action="store_true",
                    help="only the transport benchmark, on a synthetic decode step (no engine)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.transport_only:
        result = transport(synthetic_decode_step(args.batch, args.context), args.transport_steps)
        print(f"=== step transport (batch {args.batch}, context {args.context}): {result}")
        return dict(args=vars(args), transport=result)
    from compilelm import LLM

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.context + args.steps + args.profile_steps + 256,
              max_num_seqs=args.batch, max_num_batched_tokens=8192, tensor_parallel_size=args.tensor_parallel_size,
              model_overrides=args.model_overrides or {})
    runner, last = llm.engine.model_runner, []
    prepare = runner.prepare_step

    def keep_last(*a, **k):  # the decode steps' inputs, for the transport benchmark
        last[:] = [prepare(*a, **k)]
        return last[0]
    runs = []
    for mode in args.modes:
        runner.prepare_step = keep_last  # (until the phase timers restore the method)
        runs.append(measure(llm.engine, mode == "async", args))
    for r in runs:
        print(f"=== async={r['async_scheduling']} tp={args.tensor_parallel_size}: median {r['median_ms']:.3f} ms/step")
        print("\n".join(f"  {k:28s} {v:8.3f} ms/step" for k, v in r["phases_ms"].items()))
        print("\n".join(line[:150] for line in r["profile_top"]))
    payload = dict(args=vars(args), runs=runs)
    if args.tensor_parallel_size > 1 and args.transport_steps:
        decode_step = last[-1]  # the last decode step of the profile
        payload["transport"] = transport(decode_step, args.transport_steps)
        print(f"=== step transport (batch {args.batch}): {payload['transport']}")
    llm.engine.shutdown()
    print(f"wrote {write_result('profile_host', payload, args.out)}")
    return payload


if __name__ == "__main__":
    main()
