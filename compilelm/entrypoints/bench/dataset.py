"""vLLM's random dataset: prompts of random token ids, input and output lengths drawn per request.

Lengths are uniform integers in [len * (1 - ratio), len * (1 + ratio)] (`--random-range-ratio`);
every prompt starts with the same `--random-prefix-len` random ids (a shared prefix, as a system
prompt would be), then its own ids. Seeded: the same flags give the same requests.
"""

from __future__ import annotations

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
