"""vLLM's bench datasets: `random` (prompts of random token ids) and `sharegpt` (a ShareGPT JSON file).

random: lengths are uniform integers in [len * (1 - ratio), len * (1 + ratio)]
(`--random-range-ratio`); every prompt starts with the same `--random-prefix-len` random ids (a
shared prefix, as a system prompt would be), then its own ids.

sharegpt (`--dataset-path`): a JSON list of {"conversations": [{"value": ...}, {"value": ...}, ...]};
a conversation's first turn is the prompt and its second the reference completion, whose token count
is the output length unless `--sharegpt-output-len` fixes it. As vLLM's loader: the conversations are
shuffled, those with fewer than two turns skipped, and so are pairs with a prompt or completion under
4 tokens, a prompt over 1024 or both over 2048; short of `--num-prompts`, kept pairs are drawn again.

Both are seeded: the same flags give the same requests.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0,
                    flags: tuple[str, str] = ("--input-len", "--output-len")) -> list[BenchRequest]:
    """`num_prompts` requests; ids drawn from [0, vocab_size). Bad sizes raise ValueError naming the
    flag (`flags`: the caller's names of the two lengths)."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"{flags[0]} and {flags[1]} must be at least 1, got {input_len} and {output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    if vocab_size < 1:
        raise ValueError(f"the tokenizer's vocabulary is empty (size {vocab_size})")
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]

    def draw(n: int) -> int:
        return rng.randint(max(1, math.floor(n * (1 - range_ratio))), math.ceil(n * (1 + range_ratio)))

    out = []
    for _ in range(num_prompts):
        n_in, n_out = draw(input_len), draw(output_len)
        out.append(BenchRequest(prefix + [rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return out


MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048  # vLLM's is_valid_sequence defaults


def sharegpt_requests(path: str, num_prompts: int, tokenizer, output_len: int | None = None,
                      seed: int = 0) -> list[BenchRequest]:
    """`num_prompts` requests from the ShareGPT file at `path`, tokenized by `tokenizer` (an
    object with encode(text) -> ids). A file that cannot be read or is not such a list raises
    ValueError naming --dataset-path."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"--sharegpt-output-len must be at least 1, got {output_len}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset-path: cannot read {path!r} as JSON: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path: {path!r} is not a JSON list of ShareGPT conversations")
    turns = [c.get("conversations") for c in data if isinstance(c, dict)]
    pairs = [(t[0].get("value", ""), t[1].get("value", "")) for t in turns
             if isinstance(t, list) and len(t) >= 2 and all(isinstance(x, dict) for x in t[:2])]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    out = []
    for prompt, completion in pairs:
        if len(out) == num_prompts:
            break
        ids = list(tokenizer.encode(prompt))
        n_out = output_len if output_len is not None else len(tokenizer.encode(completion))
        if len(ids) < MIN_LEN or (output_len is None and n_out < MIN_LEN):
            continue
        if len(ids) > MAX_PROMPT_LEN or len(ids) + n_out > MAX_TOTAL_LEN:
            continue
        out.append(BenchRequest(ids, n_out))
    if not out:
        raise ValueError(f"--dataset-path: no usable conversation in {path!r} (two turns, 4-1024 prompt tokens, "
                         f"at least 4 completion tokens, at most 2048 together)")
    while len(out) < num_prompts:  # oversample, as vLLM does
        out.append(out[rng.randrange(len(out))])
    return out
