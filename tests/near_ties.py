"""Greedy streams of two runs that round differently may part, but only at a near-tie.

Compiled and eager code (fused and unfused ops, another kernel, fp8 quantization of a value that
moved by one fp32 ulp) round differently; on a random model's flat logits that can flip a greedy
choice, after which the streams share nothing. So a run is checked against a reference run token
by token up to its first difference, where the reference's own logits must hold a near-tie: a
wrong kernel or scale parts at once and by far more than `rel` of the largest logit. The margin
is recomputed by one eager forward of the prefix as a prefill (`forward_logits`), not read from
the decode step that chose the token: in bf16 or with an fp8 cache it carries that path's
rounding as well.
"""
from __future__ import annotations

import torch


def first_difference(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def assert_parts_only_at_near_ties(ref_llm, prompts: list[list[int]], got: list[list[int]],
                                   want: list[list[int]], rel: float = 0.02) -> list[tuple[int, int, float]]:
    """`want` are ref_llm's greedy tokens for `prompts`; returns (prompt, token, margin) per parting."""
    from benchmarks.bench_fp8_accuracy import forward_logits

    parted = []
    for k, (prompt, g, w) in enumerate(zip(prompts, got, want, strict=True)):
        assert len(g) == len(w), (k, len(g), len(w))
        i = first_difference(g, w)
        if i is None:
            continue
        logits: torch.Tensor = forward_logits(ref_llm, list(prompt) + list(w[:i]))[-1]
        margin = (logits[w[i]] - logits[g[i]]).item()
        bound = rel * logits.abs().max().item()
        assert abs(margin) < bound, f"prompt {k} parts at token {i} by {margin:.4f} (near-tie bound {bound:.4f})"
        parted.append((k, i, margin))
    return parted
