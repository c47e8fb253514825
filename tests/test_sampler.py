import math

import pytest
import torch

from compilelm.runtime.request import Request
from compilelm.runtime.sampler import (
    Sampler,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p_min_p,
    argmax_rows,
    gather_logprobs,
    sample,
)
from compilelm.sampling_params import SamplingParams


def make_request(prompt=(1, 2, 3), outputs=(), eos=None, **params):
    req = Request("r", list(prompt), SamplingParams(**params), eos_token_id=eos)
    for t in outputs:
        req.append_output_token(t)
    return req


def test_greedy_is_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    reqs = [make_request(temperature=0.0, top_k=3, top_p=0.5) for _ in range(6)]
    out = Sampler()(logits, reqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_argmax_rows_op_on_cpu():
    """The sampler's greedy path and the argmax_rows op (its CPU kernel, its fake for tracing)
    pick what argmax picks: ties (the first index wins), a NaN (it counts as the maximum), an
    all -inf row. The CUDA kernel has the same test in tests/gpu/test_sampler_gpu.py."""
    from compilelm.ops import argmax_rows as op

    x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(0))
    x[0, 7] = x[0, 4000] = 50.0
    x[1, 2500] = float("nan")
    x[2] = float("-inf")
    assert argmax_rows(x).tolist() == op(x).tolist() == x.argmax(-1).tolist()
    assert op(x).tolist()[:3] == [7, 2500, 0]
    torch.library.opcheck(torch.ops.compilelm.argmax_rows.default, (x,))


def test_model_dtype_logits_sample_as_their_fp32_values():
    """The LM head hands the sampler logits in the model dtype: greedy rows take their argmax
    as they are (bf16 ties included), everything else works on their fp32 values, so every
    choice and logprob equals the fp32 run's."""
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 4).to(torch.bfloat16)
    logits[0, 10] = logits[0, 200] = logits[0].max() + 1  # a tie: the first index wins
    greedy = [make_request(temperature=0.0) for _ in range(4)]
    assert Sampler()(logits, greedy).token_ids == Sampler()(logits.float(), greedy).token_ids
    assert Sampler()(logits, greedy).token_ids[0] == 10

    def mixed():
        return [make_request(temperature=0.0, logprobs=2), make_request(temperature=0.8, seed=1, top_k=20),
                make_request(outputs=[3, 3], repetition_penalty=1.3, temperature=0.0),
                make_request(temperature=1.0, seed=2, top_p=0.9, logprobs=1)]
    got, want = Sampler()(logits, mixed()), Sampler()(logits.float(), mixed())
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert (a is None and b is None) or (a.token_ids == b.token_ids and a.logprobs == b.logprobs)


def test_sampler_leaves_logits_untouched():
    logits = torch.randn(2, 50)
    before = logits.clone()
    reqs = [
        make_request(outputs=[4, 4], eos=1, min_tokens=5, repetition_penalty=1.5, temperature=0.0),
        make_request(temperature=0.7, top_k=5, logprobs=2),
    ]
    Sampler()(logits, reqs)
    assert torch.equal(logits, before)


def _run_steps(step_logits, make_batch, row):
    """Sample one row over several steps; other rows are whatever make_batch adds."""
    reqs = make_batch()
    tokens = []
    for logits in step_logits:
        batch = torch.randn(len(reqs), logits.shape[-1])
        batch[row] = logits
        tokens.append(Sampler()(batch, reqs).token_ids[row])
    return tokens


def test_seeded_sampling_is_independent_of_batch():
    steps = [torch.randn(500, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    kw = dict(temperature=1.5, top_p=0.95, seed=1234)

    alone = _run_steps(steps, lambda: [make_request(**kw)], row=0)
    again = _run_steps(steps, lambda: [make_request(**kw)], row=0)
    torch.manual_seed(99)  # the unseeded neighbours draw from the global RNG
    crowd = _run_steps(
        steps,
        lambda: [
            make_request(temperature=1.0),
            make_request(temperature=0.8, seed=7),
            make_request(**kw),
            make_request(temperature=0.0),
            make_request(temperature=2.0, top_k=10),
        ],
        row=2,
    )
    assert alone == again == crowd
    other_seed = _run_steps(steps, lambda: [make_request(**{**kw, "seed": 4321})], row=0)
    assert other_seed != alone


def _reference_keep(row, k, p, min_p):
    """Kept token ids for one row, computed by hand in float64 Python."""
    values = [float(v) for v in row]
    order = sorted(range(len(values)), key=lambda i: -values[i])
    kth = values[order[k - 1]]
    kept = [i for i in order if values[i] >= kth]  # ties with the k-th are kept
    # top-p over the top-k set, renormalized
    z = sum(math.exp(values[i] - values[order[0]]) for i in kept)
    cum, boundary = 0.0, values[kept[-1]]
    for i in kept:
        cum += math.exp(values[i] - values[order[0]]) / z
        if cum >= p:
            boundary = values[i]
            break
    if p < 1.0:
        kept = [i for i in kept if values[i] >= boundary]  # ties with the boundary are kept
    # min-p: prob >= min_p * max prob
    return {i for i in kept if math.exp(values[i] - values[order[0]]) >= min_p}


def test_top_k_top_p_min_p_against_reference():
    gen = torch.Generator().manual_seed(0)
    n, vocab = 64, 40
    logits = torch.randn(n, vocab, generator=gen) * 2
    logits[::4] = (logits[::4] * 2).round() / 2  # many ties
    k = torch.randint(1, vocab + 1, (n,), generator=gen)
    p = torch.rand(n, generator=gen) * 0.99 + 0.01
    min_p = torch.rand(n, generator=gen) * 0.3
    # edge rows: everything off, single filters at their extremes
    k[0], p[0], min_p[0] = vocab, 1.0, 0.0
    k[1], p[1], min_p[1] = 1, 1.0, 0.0
    k[2], p[2], min_p[2] = vocab, 1e-6, 0.0
    k[3], p[3], min_p[3] = vocab, 1.0, 1.0
    k[5], p[5], min_p[5] = vocab, 1.0, 0.0
    logits[5] = 0.0  # all tied: everything stays
    masked = apply_top_k_top_p_min_p(logits, k, p, min_p)

    for r in range(n):
        want = _reference_keep(logits[r].tolist(), int(k[r]), float(p[r]), float(min_p[r]))
        got = set(torch.isfinite(masked[r]).nonzero().flatten().tolist())
        assert got == want, f"row {r}"
        assert torch.equal(masked[r][list(got)], logits[r][list(got)])
    assert torch.isfinite(masked[0]).all() and torch.isfinite(masked[5]).all()


def test_top_p_stops_at_exact_mass():
    # probs 1/2, 1/4, 1/8, 1/8 are exact in fp32: a set whose mass equals top_p is enough
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]]) * math.log(2)
    kept = {}
    for p in [0.5, 0.75, 0.76, 0.875]:
        k, min_p = torch.tensor([4]), torch.zeros(1)
        masked = apply_top_k_top_p_min_p(logits, k, torch.tensor([p]), min_p)
        kept[p] = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert kept == {0.5: [0], 0.75: [0, 1], 0.76: [0, 1, 2, 3], 0.875: [0, 1, 2, 3]}


def _frequencies(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -3.0])
    num = 20000
    req = make_request(temperature=temperature)
    tokens = sample(logits.expand(num, -1).clone(), [req] * num).tolist()
    want = torch.softmax(logits.double() / temperature, -1)
    assert torch.allclose(_frequencies(tokens, 5), want, atol=0.015)


def test_seeded_rows_follow_the_distribution_with_top_k():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -3.0])
    num = 5000
    reqs = [make_request(temperature=0.7, top_k=3, seed=s) for s in range(num)]
    tokens = sample(logits.expand(num, -1).clone(), reqs).tolist()
    want = torch.softmax(logits.double() / 0.7, -1)
    want[3:] = 0.0
    want /= want.sum()
    assert torch.allclose(_frequencies(tokens, 5), want, atol=0.03)


def test_penalties_against_reference():
    gen = torch.Generator().manual_seed(1)
    vocab = 30
    logits = torch.randn(3, vocab, generator=gen)
    prompts = [[1, 2, 2, 5], [], [7]]
    outputs = [[2, 3, 3, 3], [9, 9], []]
    presence, frequency, repetition = [0.5, -1.0, 2.0], [0.3, 0.7, -2.0], [1.3, 0.8, 2.0]
    got = apply_penalties(
        logits, prompts, outputs,
        torch.tensor(presence), torch.tensor(frequency), torch.tensor(repetition),
    )  # fmt: skip
    want = logits.clone()
    for r in range(3):
        for t in range(vocab):
            x = want[r, t].item()
            if t in prompts[r] or t in outputs[r]:
                x = x / repetition[r] if x > 0 else x * repetition[r]
            count = outputs[r].count(t)
            x -= frequency[r] * count + presence[r] * (count > 0)
            want[r, t] = x
    torch.testing.assert_close(got, want)


def test_sampler_applies_penalties_only_where_asked():
    logits = torch.zeros(2, 10)
    logits[:, 4] = 1.0
    logits[:, 6] = 0.9
    reqs = [
        make_request(outputs=[4], temperature=0.0, frequency_penalty=0.5),
        make_request(outputs=[4], temperature=0.0),
    ]
    assert Sampler()(logits, reqs).token_ids == [6, 4]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.randn(4, 12)
    reqs = [
        make_request(outputs=[3], eos=2, min_tokens=3, stop_token_ids=[5, 7]),
        make_request(outputs=[3, 3, 3], eos=2, min_tokens=3, stop_token_ids=[5]),  # reached
        make_request(outputs=[], eos=2, min_tokens=1, ignore_eos=True, stop_token_ids=[5]),
        make_request(outputs=[], eos=None, min_tokens=2),
    ]
    got = apply_min_tokens(logits, reqs)
    want = logits.clone()
    want[0, [2, 5, 7]] = float("-inf")
    want[2, 5] = float("-inf")
    assert torch.equal(got, want)

    logits = torch.zeros(1, 12)
    logits[0, 2] = 5.0  # eos is by far the most likely
    before = make_request(outputs=[3], eos=2, min_tokens=2, temperature=0.0)
    after = make_request(outputs=[3, 3], eos=2, min_tokens=2, temperature=0.0)
    assert Sampler()(logits, [before]).token_ids != [2]
    assert Sampler()(logits, [after]).token_ids == [2]


def test_logprobs_come_from_raw_logits_with_ranks():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen)
    reqs = [
        make_request(outputs=[7, 7], temperature=0.0, repetition_penalty=2.0, logprobs=3),
        make_request(temperature=0.9, top_k=5, logprobs=0, seed=11),
        make_request(temperature=0.0),
    ]
    out = Sampler()(logits, reqs)
    assert out.logprobs[2] is None
    raw = torch.log_softmax(logits.double(), -1)
    for r, num in [(0, 3), (1, 0)]:
        lists = out.logprobs[r]
        sampled = out.token_ids[r]
        assert lists.token_ids[0] == sampled
        assert len(lists.token_ids) == len(lists.logprobs) == len(lists.ranks) == num + 1
        by_hand = sorted(range(50), key=lambda t: -raw[r, t].item())
        assert lists.ranks[0] == by_hand.index(sampled) + 1
        assert lists.token_ids[1:] == by_hand[:num]
        assert lists.ranks[1:] == list(range(1, num + 1))
        want = [raw[r, t].item() for t in lists.token_ids]
        assert lists.logprobs == pytest.approx(want, abs=1e-5)


def test_logprob_rank_with_ties_is_the_worse_rank():
    logprobs = torch.log_softmax(torch.tensor([[2.0, 1.0, 1.0, 0.0]]), -1)
    (lists,) = gather_logprobs(logprobs, torch.tensor([1]), [2])
    assert lists.ranks[0] == 3  # tokens 0, 1 and 2 are at least as likely
    assert lists.token_ids[1] == 0 and lists.ranks[1:] == [1, 2]


def test_greedy_constrained_rows_keep_the_argmax_path():
    """Greedy requests with a grammar take the argmax of their masked rows: with a full graph's
    argmax of the unmasked logits at hand, only the masked rows are taken again, written into that
    tensor in place (the next step reads its input ids there); without it, one argmax and then the
    masked rows'. Both equal the argmax of the masked fp32 logits, and the logits stay unmasked;
    a sampled row leaves the path (the full sampler, on the masked logits)."""
    from compilelm.ops.token_bitmask import mask_logits_rows_
    from compilelm.sampling_params import StructuredOutputsParams

    g = torch.Generator().manual_seed(3)
    vocab, words = 100, 4
    logits = torch.randn(6, vocab, generator=g).to(torch.bfloat16)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie in an unmasked row: the first wins
    bits = torch.randint(-2**31, 2**31 - 1, (2, words), generator=g, dtype=torch.int64).to(torch.int32)
    packed = torch.cat([bits.flatten(), torch.tensor([4, 1], dtype=torch.int32)])
    reqs = [make_request(temperature=0.0) for _ in range(6)]
    for i in (4, 1):
        reqs[i] = make_request(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    assert not reqs[4].plain_greedy and reqs[4].argmax_only
    greedy_ids = logits.argmax(-1)  # the graph's, before the masks
    want = mask_logits_rows_(logits.clone(), packed, 2, words).float().argmax(-1)
    assert not torch.equal(want, greedy_ids) and want[2] == 7  # the masks change rows 1 and 4

    before = logits.clone()
    out = Sampler().sample_tensors(logits, reqs, greedy_ids, (packed, 2, words))
    assert out.token_ids is greedy_ids and torch.equal(greedy_ids, want)
    assert torch.equal(Sampler().sample_tensors(logits, reqs, masks=(packed, 2, words)).token_ids, want)
    assert torch.equal(logits, before)
    reqs[0] = make_request(temperature=0.7, seed=1)  # not greedy: the full sampler, on the masked logits
    stale = logits.argmax(-1)
    got = Sampler().sample_tensors(logits.clone(), reqs, stale, (packed, 2, words)).token_ids
    assert got is not stale and torch.equal(got[1:], want[1:])


def test_sample_rows_ref_is_the_exponential_race():
    """sample_rows_ref (the Gumbel-max form) picks what the sampler's exponential race picks
    with the same uniforms: argmax(softmax(x / T) / E), E = -log u; inv_temperature 0 rows take
    the argmax."""
    from compilelm.ops import sample_rows_ref

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 500, generator=g) * 3
    inv_t = torch.tensor([0.0, 1.0, 2.5, 0.4] * 16)
    u = torch.rand(x.shape, generator=g)
    race = (torch.softmax(x * inv_t.unsqueeze(1), -1) / -torch.log(u)).argmax(-1)
    want = torch.where(inv_t == 0, x.argmax(-1), race)
    assert sample_rows_ref(x, inv_t, u).tolist() == want.tolist()


def test_sample_rows_op_on_cpu_follows_softmax_and_repeats_its_keys():
    from compilelm.ops import sample_rows

    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -3.0, float("-inf")])
    num, temperature = 20000, 0.7
    x = logits.expand(num, -1).contiguous()
    inv_t = torch.full((num,), 1 / temperature)
    inv_t[:10] = 0.0  # argmax rows
    keys = torch.arange(num, dtype=torch.int64) * 7919 - 2**62
    tokens = sample_rows(x, inv_t, keys)
    assert tokens[:10].tolist() == [0] * 10
    want = torch.softmax(logits.double() / temperature, -1)
    assert torch.allclose(_frequencies(tokens[10:].tolist(), 6), want, atol=0.015)
    assert torch.equal(sample_rows(x, inv_t, keys), tokens)  # same keys, same draw
    assert not torch.equal(sample_rows(x, inv_t, keys + 1), tokens)
    # a row's draw is its own: the same row and key in another batch gives the same token
    assert torch.equal(sample_rows(x[100:300], inv_t[100:300], keys[100:300]), tokens[100:300])
    torch.library.opcheck(torch.ops.compilelm.sample_rows.default, (x[:8], inv_t[:8], keys[:8]))
    with pytest.raises(RuntimeError, match=r"inv_temperature must be torch.float32 \[8\]"):
        sample_rows(x[:8], inv_t[:7], keys[:8])
    with pytest.raises(RuntimeError, match=r"keys must be torch.int64 \[8\]"):
        sample_rows(x[:8], inv_t[:8], keys[:8].int())


def test_noise_keys_of_seeded_requests_follow_seed_and_position():
    """sample_rows keys: a seeded request's depend on (seed, position of the sampled token) only;
    unseeded rows get fresh keys each call."""
    from compilelm.runtime.sampler import noise_keys

    a, b = make_request(temperature=1.0, seed=5), make_request(temperature=1.0, seed=5, outputs=(4,))
    c, free = make_request(temperature=1.0, seed=6), make_request(temperature=1.0)
    k1, k2 = noise_keys([a, b, c, free]), noise_keys([free, c, b, a])
    assert k1[0] == k2[3] and k1[1] == k2[2] and k1[2] == k2[1]  # batch order does not matter
    assert len({k1[0], k1[1], k1[2]}) == 3  # another position, another seed: another key
    assert k1[3] != k2[0]
    # the step's positions (a token in flight: the request's own count lags) decide
    assert noise_keys([a, c], positions=[4, 3]) == [k1[1], k1[2]]


def test_sample_rows_cpu_kernel_is_its_reference_with_the_keyed_uniforms():
    from compilelm.ops import sample_rows, sample_rows_ref

    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(2))
    inv_t = torch.tensor([0.0, 1.0, 2.0, 0.5, 0.0, 1.0, 1.0, 3.0])
    keys = torch.arange(8) * 977 - 5
    uniform = torch.stack([torch.empty(1000).uniform_(generator=torch.Generator().manual_seed(k % 2**64))
                           for k in keys.tolist()])
    assert sample_rows(x, inv_t, keys).tolist() == sample_rows_ref(x, inv_t, uniform).tolist()
    # a floor leaves the draw to the columns with x * inv_t >= floor: the draw on the masked logits
    floor = torch.tensor([0.0, 0.5, 1.0, -float("inf"), 2.0, 1.5, 3.0, 2.5])
    got = sample_rows(x, inv_t, keys, floor)
    assert got.tolist() == sample_rows_ref(x, inv_t, uniform, floor).tolist()
    masked = x.masked_fill(x * inv_t.unsqueeze(1) < floor.unsqueeze(1), float("-inf"))
    sampled = inv_t > 0
    assert got[sampled].tolist() == sample_rows(masked, inv_t, keys)[sampled].tolist()
    assert (x[sampled].gather(1, got[sampled].unsqueeze(1)).squeeze(1) * inv_t[sampled] >= floor[sampled]).all()
    assert got[~sampled].tolist() == x[~sampled].argmax(-1).tolist()  # greedy rows: no floor
    torch.library.opcheck(torch.ops.compilelm.sample_rows.default, (x, inv_t, keys, floor))


def test_filtered_rows_draw_what_the_masked_logits_draw():
    """The sampler's filters as sample_rows' floor (filter_floor) draw what sample_rows draws on the
    logits masked by apply_top_k_top_p_min_p, for rows of top-k, top-p, min-p and greedy, in bf16."""
    from compilelm.ops import sample_rows
    from compilelm.runtime.sampler import filter_floor, noise_keys, sample

    vocab = 3000
    x = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    specs = [dict(temperature=0.7, top_k=20, top_p=0.9), dict(temperature=1.0, top_p=0.5),
             dict(temperature=0.0), dict(temperature=1.3, min_p=0.2), dict(temperature=0.6, top_k=5),
             dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.05)]
    requests = [make_request(seed=10 + i, **kw) for i, kw in enumerate(specs)]
    params = [r.sampling_params for r in requests]
    inv_t = torch.tensor([0.0 if p.is_greedy else 1 / p.temperature for p in params])
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p, min_p = torch.tensor([p.top_p for p in params]), torch.tensor([p.min_p for p in params])
    keys = torch.tensor(noise_keys(requests))
    floor = filter_floor(x, inv_t, k, top_p, min_p)
    assert floor[2] == -float("inf")
    scaled = x.float() * inv_t.unsqueeze(1)
    masked = apply_top_k_top_p_min_p(scaled, k, top_p, min_p)
    assert torch.equal(torch.isinf(masked[inv_t > 0]), (scaled < floor.unsqueeze(1))[inv_t > 0])
    want = sample_rows(x.masked_fill(torch.isinf(masked) & (inv_t > 0).unsqueeze(1), float("-inf")), inv_t, keys)
    assert sample(x, requests).tolist() == want.tolist()


def test_seeded_plain_rows_draw_the_same_tokens_in_any_batch():
    """A seeded temperature-only request's token depends on its seed, position and logits only:
    alone, in another order, or beside a top-p row (which sends the batch down the general path)."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4))
    seeded = [make_request(temperature=0.9, seed=s) for s in range(5)]
    alone = Sampler()(logits[:5], seeded).token_ids
    assert Sampler()(logits[:5].flip(0), seeded[::-1]).token_ids == alone[::-1]
    top_p = make_request(temperature=0.9, top_p=0.5)
    assert Sampler()(logits, seeded + [top_p]).token_ids[:5] == alone
    assert Sampler()(logits[:5], seeded).token_ids == alone  # and again: keyed, no generator state


@pytest.mark.parametrize("ties", [False, True])
def test_filters_from_top_candidates_match_the_sort(ties):
    """apply_top_k_top_p_min_p from each row's top candidates (torch.topk, filter_candidates) keeps
    exactly the tokens the sort of the vocabulary keeps: rows with top-k (with and without top-p
    and min-p), min-p alone, no filter; logits rounded to bf16 (ties at the k-th logit)."""
    from compilelm.runtime.sampler import filter_candidates

    vocab = 5000
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(9)) * 4
    if ties:
        logits = logits.bfloat16().float()
    filters = [(20, 0.95, 0.0), (1, 1.0, 0.0), (50, 1.0, 0.1), (vocab, 1.0, 0.2), (vocab, 1.0, 0.0),
               (300, 0.5, 0.0), (7, 0.9, 0.05)]
    candidates = filter_candidates(filters, vocab)
    assert candidates == 2 * 300 + 64
    k, p, min_p = (torch.tensor([f[i] for f in filters]) for i in range(3))
    want = apply_top_k_top_p_min_p(logits, k, p.float(), min_p.float(), candidates=vocab)  # the sort
    got = apply_top_k_top_p_min_p(logits, k, p.float(), min_p.float(), candidates=candidates)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert filter_candidates(filters + [(vocab, 0.9, 0.0)], vocab) is None  # top-p without top-k: sort
    assert filter_candidates([(3000, 1.0, 0.0)], vocab) is None  # more candidates than the cap


@pytest.mark.parametrize("ties", [False, True])
def test_cpu_top_p_from_nucleus_candidates_matches_the_sort(ties):
    """Top-p without top-k on the CPU: where every such row's nucleus lies in its top 1024 logits
    the thresholds come from them (the same tokens as the sort keeps), else the sort runs."""
    from compilelm.runtime.sampler import _floor

    vocab = 20000
    g = torch.Generator().manual_seed(5)
    peaked = torch.randn(6, vocab, generator=g) * 6  # a few hundred tokens hold most of the mass
    if ties:
        peaked = peaked.bfloat16().float()
    k = torch.tensor([vocab, vocab, 40, vocab, vocab, 1])
    p = torch.tensor([0.9, 0.5, 0.95, 1.0, 0.99, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0])
    sort = apply_top_k_top_p_min_p(peaked, k, p, min_p, candidates=vocab)
    ones = torch.ones(len(k))
    floor = _floor(peaked, ones, k, p, min_p, 1024, nucleus=True)
    assert floor is not None and torch.equal(peaked < floor.unsqueeze(1), torch.isinf(sort))
    assert torch.equal(torch.isinf(apply_top_k_top_p_min_p(peaked, k, p, min_p)), torch.isinf(sort))
    flat = torch.randn(6, vocab, generator=g) * 0.1  # the nucleus spans most of the vocabulary
    assert _floor(flat, ones, k, p, min_p, 1024, nucleus=True) is None
    assert torch.equal(apply_top_k_top_p_min_p(flat, k, p, min_p), apply_top_k_top_p_min_p(flat, k, p, min_p,
                                                                                          candidates=vocab))
