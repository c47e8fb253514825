"""What a step's grammar masks cost on the host, without a model: the host side of a constrained
batch (bench_structured's schema, a JSON array of records, on the bundled SmolLM2 tokenizer).

`--rows` matchers advance together, each by a random token its mask allows (fresh matchers
replace finished ones); every step fills all their masks four ways, checked equal:

- per row: `LLMatcher.unsafe_compute_mask_ptr` one after another on this thread (each drops the GIL);
- executor: one `LLExecutor.unsafe_compute_mask_ptr` call for all rows (llguidance's threads);
- mask thread: `MaskFiller.start` + `result()`, the engine's path (the executor on a thread of its
  own, after handing it the GIL): the hand-over's cost is its time less the executor's;
- accept: the rows' `RequestGrammar.accept` (consume_token) of the chosen tokens.

Prints medians and p90s in microseconds per step (and one row's median and p99), JSON to
benchmarks/results/profile_masks.json. CPU only (the bundled tokenizer where the default model is not
installed): run it on the machine whose host a GPU run used.

    python benchmarks/profile_masks.py [--rows 8] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_result  # noqa: E402


def allowed_token(mask_row, rng: random.Random) -> int:
    """A random token whose bit is set in an int32 mask row."""
    import torch

    words = torch.nonzero(mask_row).flatten().tolist()
    w = rng.choice(words)
    bits = int(mask_row[w]) & 0xFFFFFFFF
    return 32 * w + rng.choice([j for j in range(32) if bits >> j & 1])


def measure(rows: int, steps: int, seed: int = 0) -> dict:
    import torch

    from benchmarks.bench_structured import RECORDS, resolve_model_and_tokenizer
    from compilelm.models.loader import resolve_model
    from compilelm.models.tokenizer import load_tokenizer
    from compilelm.runtime.structured_output import GuidanceBackend, RequestGrammar
    from compilelm.sampling_params import StructuredOutputsParams

    where = argparse.Namespace(model=None, tokenizer=None)
    resolve_model_and_tokenizer(where)  # the default model's tokenizer, or its bundled copy
    tok = load_tokenizer(resolve_model(where.model), where.tokenizer)
    backend = GuidanceBackend(tok, len(tok), [tok.eos_token_id])
    params = StructuredOutputsParams(json=RECORDS)
    grammars = [RequestGrammar(backend.matcher(params), backend) for _ in range(rows)]
    executor, filler = backend.mask_executor(), backend.mask_filler(pin=False)
    words = filler.words
    seq, par = (torch.empty(rows * words, dtype=torch.int32) for _ in range(2))
    rng = random.Random(seed)
    times: dict[str, list[float]] = {"per row": [], "executor": [], "mask thread": [], "accept": [], "one row": []}
    for step in range(steps):
        matchers = [g.matcher for g in grammars]
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(seq.data_ptr() + 4 * i * words, 4 * words)
            times["one row"].append(time.perf_counter() - t)
        t1 = time.perf_counter()
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], par.data_ptr(), 4 * words, rows)
        t2 = time.perf_counter()
        threaded = filler.start(matchers, list(range(rows))).result()
        t3 = time.perf_counter()
        if not (torch.equal(seq, par) and torch.equal(seq, threaded[:rows * words])):
            raise AssertionError(f"step {step}: the three fills differ")
        tokens = [allowed_token(row, rng) for row in seq.view(rows, words)]
        t4 = time.perf_counter()
        for i, g in enumerate(grammars):
            g.accept(tokens[i], g.num_accepted, f"r{i}")
        t5 = time.perf_counter()
        for i, g in enumerate(grammars):
            if g.is_terminated or g.failed:
                grammars[i] = RequestGrammar(backend.matcher(params), backend)
        if step >= min(20, steps // 4):  # warm-up: first masks, thread start
            for name, dt in (("per row", t1 - t0), ("executor", t2 - t1), ("mask thread", t3 - t2),
                             ("accept", t5 - t4)):
                times[name].append(dt)
    backend.shutdown()

    def pct(xs: list[float], q: float) -> float:
        return 1e6 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    return {name: {"median_us": 1e6 * statistics.median(xs), "p90_us": pct(xs, 0.9), "p99_us": pct(xs, 0.99)}
            for name, xs in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8, help="constrained rows a step (bench_structured: 8 of 64)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = measure(args.rows, args.steps)
    table = [{"what": name + (" (of one row)" if name == "one row" else f" ({args.rows} rows)"), **r}
             for name, r in result.items()]
    print_table(table, ["what", "median_us", "p90_us", "p99_us"])
    payload = {"rows": args.rows, "steps": args.steps, "results": result}
    print("wrote", write_result("profile_masks", payload, args.out))
    return payload


if __name__ == "__main__":
    main()
