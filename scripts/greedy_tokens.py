"""Greedy token ids of a few models, as JSON: run it on two trees (before and after a change) and
compare the files. Random-weight presets are seeded, so both runs see the same weights.

    python scripts/greedy_tokens.py OUT.json [--models dummy:qwen3-0.6b dummy:llama-3.1-8b] [--tokens 24]
"""

from __future__ import annotations

import argparse
import gc
import json

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           list(range(100, 164))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", nargs="+", default=["default"])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()

    import torch

    from compilelm import LLM, SamplingParams

    result = {}
    for name in args.models:
        llm = LLM(None if name == "default" else name, enforce_eager=args.enforce_eager, seed=0)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
                            use_tqdm=False)
        result[name] = [list(o.outputs[0].token_ids) for o in outs]
        print(name, [o.outputs[0].token_ids[:8] for o in outs], flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
