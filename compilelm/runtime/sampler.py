"""Turns the last-position logits of a batch into one token per request.

Order (vLLM's): logprobs from the raw logits -> min_tokens mask -> penalties -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> a sample, drawn by sample_rows (the Gumbel-max trick:
the exponential race's draw in one pass over the logits; one kernel on CUDA). The filters become a
threshold per row (from each row's top tokens, or a sort where top-p comes without top-k) that
sample_rows applies as it reads the logits: no masked copy of the vocabulary. A batch of plain rows
(greedy, or temperature alone: Request.plain_sample) goes straight to sample_rows, on the logits
in their own dtype. Per-row parameters become
tensors once per call (pinned host -> device, non-blocking: launching the sampler never waits for
the GPU), so every step is a handful of batched kernels. `sample_tensors` leaves the result on the
device (async scheduling copies it to the host later); `__call__` also brings it to the host,
where the `.tolist()` calls are the only waits. A seeded request's noise is keyed by (seed, token
position), so its tokens do not depend on what else is in the batch, on the path the batch takes
or on async scheduling.
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compilelm.ops import argmax_rows as fused_argmax_rows
from compilelm.ops import sample_rows as fused_sample_rows
from compilelm.ops import token_bitmask

if TYPE_CHECKING:
    from compilelm.runtime.request import Request


@dataclass
class LogprobsLists:
    """Logprobs of one position, on the host. Entry 0 is the sampled (or given) token."""

    token_ids: list[int]  # [1 + num_logprobs]: sampled token, then the top tokens by rank
    logprobs: list[float]
    ranks: list[int]  # 1 = most likely


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per request
    logprobs: list[LogprobsLists | None]  # None where the request asked for none


@dataclass
class SampledTensors:
    """A sampler result before it reaches the host (device tensors, or their pinned host copies)."""

    token_ids: torch.Tensor  # int64 [num_reqs]
    lp_rows: list[int]  # the rows that asked for logprobs
    num_logprobs: list[int]  # [len(lp_rows)]
    lp_token_ids: torch.Tensor | None = None  # int64 [len(lp_rows), 1 + max num_logprobs]
    lp_values: torch.Tensor | None = None  # fp32, same shape
    lp_ranks: torch.Tensor | None = None  # int64 [len(lp_rows)]

    def to_host_async(self) -> SampledTensors:
        """Pinned host copies of device tensors, queued without waiting (valid once the stream
        reaches them: record an event after this); tensors already on the CPU are kept."""
        def move(t):
            if t is None or t.device.type == "cpu":
                return t
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        return SampledTensors(move(self.token_ids), self.lp_rows, self.num_logprobs, move(self.lp_token_ids),
                              move(self.lp_values), move(self.lp_ranks))

    def to_output(self) -> SamplerOutput:
        """Host lists (waits for the device if the tensors are still there)."""
        logprobs: list[LogprobsLists | None] = [None] * len(self.token_ids)
        if self.lp_rows:
            lists = logprobs_lists(self.lp_token_ids, self.lp_values, self.lp_ranks, self.num_logprobs)
            for i, entry in zip(self.lp_rows, lists):
                logprobs[i] = entry
        return SamplerOutput(token_ids=self.token_ids.tolist(), logprobs=logprobs)


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        return self.sample_tensors(logits, requests).to_output()

    def sample_tensors(self, logits: torch.Tensor, requests: list[Request],
                       greedy_ids: torch.Tensor | None = None,
                       masks: tuple[torch.Tensor, int, int] | None = None,
                       positions: list[int] | None = None) -> SampledTensors:
        # logits: [num_reqs, vocab], the model's dtype or fp32; greedy_ids: the argmax of the
        # logits where already computed (int64 [num_reqs]: a full CUDA graph's, fused into its LM
        # head); masks: the grammar masks of the constrained rows, not yet applied, as
        # (packed int32 on logits' device, k, words) (compilelm/ops/token_bitmask.py), None if none;
        # positions: each row's sampled token's index in its sequence (the step's), None: the
        # request's next (nothing in flight)
        if all(r.argmax_only for r in requests):  # the common case: one argmax, no host passes
            ids = greedy_ids if greedy_ids is not None else argmax_rows(logits)
            if masks is not None:  # only the masked rows change: their argmax into ids, in place
                token_bitmask.masked_argmax_rows_(logits, *masks, out=ids)
            return SampledTensors(ids, [], [])
        if masks is not None:
            logits = token_bitmask.mask_logits_rows_(logits, *masks)
        if (not logits.is_cuda or sample_rows_fits(logits)) and all(r.plain_sample for r in requests):
            # temperature sampling and argmax rows: one kernel over the logits in their dtype (CPU:
            # torch ops over keyed uniforms)
            return SampledTensors(sample_plain(logits, requests, positions), [], [])
        # logprobs and penalties work in fp32, as vLLM's sampler does; the filters and the draw read
        # the logits in their dtype (fp32 products of its values: the same draws)
        params = [r.sampling_params for r in requests]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            raw_logprobs = torch.log_softmax(logits.index_select(0, _index(lp_rows, logits)).float(), dim=-1)

        logits = apply_min_tokens(logits, requests)
        pen_rows = [i for i, r in enumerate(requests) if r.has_penalties]
        if pen_rows:
            logits = logits.float()
            pen, pen_index = [params[i] for i in pen_rows], _index(pen_rows, logits)
            penalized = apply_penalties(
                logits.index_select(0, pen_index),
                [requests[i].prompt_token_ids for i in pen_rows],
                [requests[i].output_token_ids for i in pen_rows],
                _row_tensor([p.presence_penalty for p in pen], logits),
                _row_tensor([p.frequency_penalty for p in pen], logits),
                _row_tensor([p.repetition_penalty for p in pen], logits),
            )
            logits = logits.index_put((pen_index,), penalized)

        sampled = sample(logits, requests, positions)  # int64 [num_reqs]

        out = SampledTensors(sampled, lp_rows, [params[i].logprobs for i in lp_rows])
        if lp_rows:
            out.lp_token_ids, out.lp_values, out.lp_ranks = gather_logprobs_tensors(
                raw_logprobs, sampled.index_select(0, _index(lp_rows, sampled)), max(out.num_logprobs))
        return out


def sample_plain(logits: torch.Tensor, requests: list[Request], positions: list[int] | None = None) -> torch.Tensor:
    """Greedy and temperature-only rows (Request.plain_sample) through sample_rows, keyed by
    noise_keys; logits: [n, vocab] in any float dtype -> int64 [n]."""
    inv_t = _row_tensor(_inv_temperatures(requests), logits)
    keys = _row_tensor(noise_keys(requests, positions), logits, torch.int64)
    return fused_sample_rows(logits, inv_t, keys)


def sample(logits: torch.Tensor, requests: list[Request], positions: list[int] | None = None) -> torch.Tensor:
    """Greedy rows take the argmax; the others sample after temperature/top-k/top-p/min-p, through
    sample_rows keyed by noise_keys (`positions` as there): the filters become each row's floor
    (filter_floor), which sample_rows applies as it reads the logits."""
    # logits: [num_reqs, vocab], any float dtype -> int64 [num_reqs]
    if all(r.inv_temperature == 0.0 for r in requests):
        return argmax_rows(logits)
    vocab = logits.shape[-1]
    # (k, p, min_p) a row filters by (vocab, 1, 0: off); greedy rows none (sample_rows: their argmax)
    filters = [(k if 0 < k < vocab else vocab, top_p, min_p) for k, top_p, min_p in (r.filters for r in requests)]
    if all(f == (vocab, 1.0, 0.0) for f in filters):  # plain sampling (no filter) is the common case
        return sample_plain(logits, requests, positions)
    # one host -> device copy per dtype: (inv_t, top-p, min-p) and (top-k, key) of every row
    inv_t, top_p, min_p = _row_tensor([_inv_temperatures(requests), [f[1] for f in filters],
                                       [f[2] for f in filters]], logits).unbind(0)
    top_k, keys = _row_tensor([[f[0] for f in filters], noise_keys(requests, positions)], logits,
                              torch.int64).unbind(0)
    floor = filter_floor(logits, inv_t, top_k, top_p, min_p, candidates=filter_candidates(filters, vocab))
    return fused_sample_rows(logits, inv_t, keys, floor)


def _inv_temperatures(requests: list[Request]) -> list[float]:
    return [r.inv_temperature for r in requests]


def noise_keys(requests: list[Request], positions: list[int] | None = None) -> list[int]:
    """Each row's sample_rows key (int64): a seeded request's from its seed and the position of the
    token it samples (`positions`, the step's: the same draw in any batch, under async scheduling,
    and again after a preemption's recompute; None: the request's next token); the others' fresh
    from the global generator (LLM(seed=...) repeats them)."""
    keys = torch.randint(2**63 - 1, (len(requests),), dtype=torch.int64).tolist()
    for i, r in enumerate(requests):
        seed = r.sampling_params.seed
        if seed is not None:
            keys[i] = _mix64(seed, r.num_tokens if positions is None else positions[i])
    return keys


def _mix64(seed: int, position: int) -> int:
    """SplitMix64's finalizer of seed and position, as a signed 64-bit int."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z


def sample_rows_fits(x: torch.Tensor) -> bool:
    """The rows kernel of csrc/cuda/argmax_kernels.cu takes x: CUDA, at most 65535 rows (its
    grid), columns contiguous."""
    return x.is_cuda and x.shape[0] <= 65535 and x.stride(-1) == 1


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (the first maximum; NaN counts as the maximum). On CUDA one kernel
    (compilelm/ops/sampling.py): torch's argmax spreads a row over few blocks and a
    max-then-argmax takes five kernels (docs/perf.md, "The LM head and greedy argmax")."""
    if not sample_rows_fits(x):
        return x.argmax(dim=-1)
    return fused_argmax_rows(x)


TOP_K_CANDIDATES = 4096  # most top tokens the filters read instead of sorting the vocabulary


def filter_candidates(filters: list[tuple[int, float, float]], vocab: int) -> int | None:
    """How many top tokens apply_top_k_top_p_min_p needs for these rows' (k, p, min_p) (vocab = no
    top-k): None (sort the vocabulary) where a row takes top-p without top-k, else twice the largest
    k and 64 more, room for tokens tied with a k-th logit (bf16 models' logits tie often)."""
    if any(k >= vocab and p < 1.0 for k, p, _ in filters):
        return None
    n = 2 * max((k for k, _, _ in filters if k < vocab), default=1) + 64
    return n if n <= min(TOP_K_CANDIDATES, vocab) else None


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor, candidates: int | None = None
) -> torch.Tensor:
    """Set the logits of dropped tokens to -inf; each filter keeps at least the top token.

    top-k keeps the k largest, top-p the smallest top set whose probability (renormalized after
    top-k) reaches p, min-p the tokens with prob >= min_p * max prob. Each filter becomes a
    per-row logit threshold, and tokens tied with a threshold are kept, so the result does not
    depend on how sort orders ties. With `candidates` the thresholds come from each row's top
    `candidates` logits (torch.topk) instead of a sort of the vocabulary: the same wherever a row
    with top-p has top-k too and its tokens tied with the k-th fit in the candidates (see
    filter_candidates).
    """
    # logits: fp32 [n, vocab]; k: int64 [n] in [1, vocab] (vocab = off);
    # p: fp32 [n] (1 = off); min_p: fp32 [n] (0 = off)
    ones = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    floor = filter_floor(logits, ones, k, p, min_p, candidates)
    return logits.masked_fill(logits < floor.unsqueeze(1), float("-inf"))


def filter_floor(logits: torch.Tensor, inv_t: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor,
                 candidates: int | None = None) -> torch.Tensor:
    """apply_top_k_top_p_min_p's thresholds over the probabilities softmax(logits * inv_t): a row
    keeps the tokens with logits * inv_t (fp32) >= its floor (sample_rows' `floor`); -inf where
    inv_t is 0 (greedy rows)."""
    # logits: [n, vocab] any float dtype; inv_t: fp32 [n]; k, p, min_p as apply_top_k_top_p_min_p's
    # -> fp32 [n]
    vocab = logits.shape[-1]
    floor = None
    if candidates is None and not logits.is_cuda:  # the CPU looks at the top tokens before it sorts
        n = max(NUCLEUS_CANDIDATES, 2 * int(k.masked_fill(k >= vocab, 1).max()) + 64)
        if n < vocab and n <= TOP_K_CANDIDATES:
            floor = _floor(logits, inv_t, k, p, min_p, n, nucleus=True)
    if floor is None:
        n = candidates if candidates is not None and candidates < vocab else None
        floor = _floor(logits, inv_t, k, p, min_p, n)
    return floor.masked_fill(inv_t == 0, float("-inf"))


NUCLEUS_CANDIDATES = 1024  # the CPU's first look for a top-p set without top-k


def _floor(logits: torch.Tensor, inv_t: torch.Tensor, k: torch.Tensor, p: torch.Tensor, min_p: torch.Tensor,
           n: int | None, nucleus: bool = False) -> torch.Tensor | None:
    """filter_floor from each row's top `n` logits (None: the sorted vocabulary). With `nucleus` a
    row with top-p and no top-k reads its probabilities over the whole row, and the result is None
    (sort instead) where its nucleus is not among the n: on the CPU that check costs nothing, on a
    GPU it would wait for the device, so CUDA never asks for it."""
    vocab = logits.shape[-1]
    top = logits.sort(dim=-1, descending=True).values if n is None else logits.topk(n, dim=-1).values
    desc = top.float() * inv_t.unsqueeze(1)  # [rows, n or vocab], descending (inv_t >= 0)
    width = desc.shape[-1]
    k_off = k >= vocab  # no top-k
    kth = desc.gather(1, (k - 1).clamp(0, width - 1).unsqueeze(1))  # [rows, 1]
    kth = kth.masked_fill(k_off.unsqueeze(1), float("-inf"))
    desc = desc.masked_fill(desc < kth, float("-inf"))
    if nucleus:  # rows with top-k: mass after top-k (all of it among the n); without: the whole row's
        whole = (logits.float() * inv_t.unsqueeze(1)).logsumexp(dim=-1, keepdim=True)
        norm = torch.where(k_off.unsqueeze(1), whole, desc.logsumexp(dim=-1, keepdim=True))
        cum = (desc - norm).exp().cumsum(dim=-1)
        if not bool(((cum[:, -1] >= p) | ~(k_off & (p < 1.0))).all()):
            return None
    else:
        cum = desc.softmax(dim=-1).cumsum(dim=-1)  # mass of the top j+1 tokens
    num_below = (cum < p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(max=width - 1)
    pth = desc.gather(1, num_below)  # smallest logit of the kept top-p set
    pth = pth.masked_fill(p.unsqueeze(1) >= 1.0, float("-inf"))  # p == 1 keeps all, exactly
    mth = desc[:, :1] + min_p.unsqueeze(1).log()  # prob >= min_p * max prob; log(0) = -inf
    return torch.maximum(torch.maximum(kth, pth), mth).squeeze(1)


def apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Forbid EOS and stop_token_ids while a request has fewer than min_tokens outputs."""
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(requests):
        if not r.min_tokens or r.num_output_tokens >= r.min_tokens:
            continue
        p = r.sampling_params
        stop_ids = set(p.stop_token_ids)
        if r.eos_token_id is not None and not p.ignore_eos:
            stop_ids.add(r.eos_token_id)
        rows += [i] * len(stop_ids)
        cols += sorted(stop_ids)
    if not rows:
        return logits
    index = (_index(rows, logits), _index(cols, logits))
    return logits.index_put(index, torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output, frequency/presence over the output."""
    # logits: fp32 [n, vocab]; presence, frequency, repetition: fp32 [n]
    n, vocab = logits.shape
    output_counts = _token_counts(output_token_ids, n, vocab, logits.device)  # [n, vocab]
    seen = (_token_counts(prompt_token_ids, n, vocab, logits.device) + output_counts) > 0
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int]
) -> list[LogprobsLists]:
    """The logprob and rank of `token_ids`, plus each row's top `num_logprobs[i]` tokens.

    Also serves prompt logprobs: pass one row per prompt position and the next prompt token.
    Rank counts tokens at least as likely, so ties share the worse rank (as in vLLM).
    """
    # logprobs: fp32 [n, vocab] (log_softmax); token_ids: int64 [n]
    ids, values, ranks = gather_logprobs_tensors(logprobs, token_ids, max(num_logprobs, default=0))
    return logprobs_lists(ids, values, ranks, num_logprobs)


def gather_logprobs_tensors(
    logprobs: torch.Tensor, token_ids: torch.Tensor, max_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gather_logprobs` on the device: ids int64 [n, 1 + max_k], values fp32 [n, 1 + max_k]
    (the given token, then the top max_k), ranks int64 [n] of the given token."""
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = (logprobs >= token_logprobs).sum(dim=-1)  # [n]
    top = logprobs.topk(max_k, dim=-1)  # [n, max_k]
    return (torch.cat([token_ids.unsqueeze(1), top.indices], dim=1),
            torch.cat([token_logprobs, top.values], dim=1), ranks)


def logprobs_lists(ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor,
                   num_logprobs: list[int]) -> list[LogprobsLists]:
    """Row i keeps its first 1 + num_logprobs[i] entries."""
    ids, values, ranks = ids.tolist(), values.tolist(), ranks.tolist()
    return [
        LogprobsLists(ids[i][: k + 1], values[i][: k + 1], [ranks[i], *range(1, k + 1)])
        for i, k in enumerate(num_logprobs)
    ]


def _token_counts(token_ids: list[list[int]], n: int, vocab: int, device) -> torch.Tensor:
    """Per-row token counts: fp32 [n, vocab], built with one scatter_add."""
    rows = [i for i, ids in enumerate(token_ids) for _ in ids]
    cols = [t for ids in token_ids for t in ids]
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    if cols:
        index = (_index(rows, counts), _index(cols, counts))
        counts.index_put_(index, torch.ones(len(cols), device=device), accumulate=True)
    return counts


_ARRAY_CODES = {torch.float32: "f", torch.int64: "q"}


def _row_tensor(values: list, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """A host list (or a list of equal-length lists: a 2-D tensor) on `like`'s device; to a GPU
    through pinned memory without waiting for it (a plain `torch.tensor(..., device='cuda')`
    synchronizes the stream). Built through a packed array: a third of torch.tensor's time on a
    list of Python numbers."""
    rows = len(values) if values and isinstance(values[0], list) else None
    packed = array.array(_ARRAY_CODES[dtype], itertools.chain.from_iterable(values) if rows is not None else values)
    if not packed:
        host = torch.tensor(values, dtype=dtype)
    else:
        host = torch.frombuffer(packed, dtype=dtype)
        host = host.view(rows, -1) if rows is not None else host
    if like.device.type == "cpu":
        return host
    return host.pin_memory().to(like.device, non_blocking=True)


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return _row_tensor(values, like, torch.int64)
