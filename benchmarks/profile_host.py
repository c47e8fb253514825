"""Host time of decode steps, async scheduling on vs off, on one engine (CUDA).

`batch` requests with random `context`-token prompts decode; for each mode the median wall time
of `engine.step()` is taken over `--steps` steps; `--profile-steps` more run with each part of the
step timed (PHASES: schedule, prepare_step, run_step, _sample, _process_step), and as many again
under cProfile, whose functions with the most own time are printed. With async scheduling a step costs
max(host, GPU) instead of host + GPU, so the gap between the two medians is the host time hidden
behind the GPU. Past results: docs/perf.md, "Host overhead and async scheduling".

    python benchmarks/profile_host.py [--model dummy:smollm2-135m] [--batch 64] [--context 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
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


@contextlib.contextmanager
def phase_timers(engine, totals: dict[str, float]):
    """Sums the wall time of each PHASES method into `totals` (seconds), wrapping it on its instance."""
    patched = []
    for owner_name, method in PHASES:
        owner = getattr(engine, owner_name) if owner_name else engine
        time_calls(owner, method, totals, f"{owner_name or 'engine'}.{method}")
        patched.append((owner, method))
    try:
        yield
    finally:
        for owner, method in patched:
            delattr(owner, method)  # the class's method again


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from compilelm import LLM

    llm = LLM(args.model, dtype="bfloat16", max_model_len=args.context + args.steps + args.profile_steps + 256,
              max_num_seqs=args.batch, max_num_batched_tokens=8192)
    runs = [measure(llm.engine, mode, args) for mode in (True, False)]
    for r in runs:
        print(f"=== async={r['async_scheduling']}: median {r['median_ms']:.3f} ms/step")
        print("\n".join(f"  {k:28s} {v:8.3f} ms/step" for k, v in r["phases_ms"].items()))
        print("\n".join(line[:150] for line in r["profile_top"]))
    payload = dict(args=vars(args), runs=runs)
    print(f"wrote {write_result('profile_host', payload, args.out)}")
    return payload


if __name__ == "__main__":
    main()
