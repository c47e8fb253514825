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


def _assert_near_tie(k: int, i: int, margin: float, logits: torch.Tensor, rel: float) -> tuple[int, int, float]:
    bound = rel * logits.abs().max().item()
    assert abs(margin) < bound, f"prompt {k} parts at token {i} by {margin:.4f} (near-tie bound {bound:.4f})"
    return k, i, margin


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
        parted.append(_assert_near_tie(k, i, (logits[w[i]] - logits[g[i]]).item(), logits, rel))
    return parted


def assert_parts_only_at_decode_near_ties(ref_llm, prompts: list[list[int]], got: list[list[int]],
                                          want: list[list[int]], want_logprobs: list[list[dict]],
                                          rel: float = 0.1, agree: float = 0.75) -> list[tuple[int, int, float]]:
    """As `assert_parts_only_at_near_ties`, for runs with an fp8 KV cache: the margin at a parting
    is the one the reference run's own decode saw (its top logprobs at that step, `want_logprobs`
    [prompt][step] -> {token: Logprob}; logprob differences are logit differences). A prefill of
    the prefix quantizes other bf16 values into the cache (another GEMM's rounding), which moves a
    margin by more than a near-tie. The decode path is checked against the prefill path instead,
    at every step: the reference's logprob of its token within `agree` of the prefill's (a wrong
    decode kernel or scale is off by far more; the same wrong kernel in both runs would agree)."""
    from benchmarks.bench_fp8_accuracy import forward_logits

    parted = []
    for k, (prompt, g, w, lps) in enumerate(zip(prompts, got, want, want_logprobs, strict=True)):
        assert len(g) == len(w) == len(lps), (k, len(g), len(w), len(lps))
        parting = first_difference(g, w)
        for i, token in enumerate(w):
            logits = forward_logits(ref_llm, list(prompt) + list(w[:i]))[-1]
            prefill = torch.log_softmax(logits, -1)[token].item()
            assert abs(lps[i][token].logprob - prefill) < agree, (
                f"prompt {k} token {i}: decode logprob {lps[i][token].logprob:.4f}, prefill {prefill:.4f}")
            if i == parting:
                assert g[i] in lps[i], f"prompt {k} parts at token {i} to {g[i]}, not among {sorted(lps[i])}"
                parted.append(_assert_near_tie(k, i, lps[i][token].logprob - lps[i][g[i]].logprob, logits, rel))
                break
    return parted
