"""`compilelm generate "prompt"`: load a model, print one completion."""

from __future__ import annotations

import argparse
import sys

from compilelm.entrypoints.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for a prompt")
    p.add_argument("prompt", help="the prompt text")
    add_engine_args(p, model_positional=False)
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from compilelm.llm import LLM
    from compilelm.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        raise ValueError(f"--{str(e).split()[0].replace('_', '-')}: {e}") from e
    llm = LLM(engine_config=engine_config_from_args(args))
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    sys.stdout.write(out[0].outputs[0].text + "\n")
    return 0
