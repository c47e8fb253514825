"""ModelRunner.prepare_step (vectorized) against a per-request reference, on random schedules:
fresh and chunked prefills, decodes, decodes of a token still on the device (async scheduling),
prompt-logprob rows, block tables of different widths."""

import random
import types

import numpy as np
import pytest

from compilelm.graphs.cudagraph.dispatch import CudaGraphDispatcher
from compilelm.runtime.model_runner import ModelRunner
from compilelm.runtime.request import Request
from compilelm.runtime.scheduler import ScheduledRequest, SchedulerOutput
from compilelm.sampling_params import SamplingParams

BLOCK = 16


def reference(sched: SchedulerOutput, last_sampled: dict):
    """One request at a time, the plainest way: the arrays prepare_step must produce."""
    ids, pos, slots, cu, seq_lens, sampled, prompt_rows, pending = [], [], [], [0], [], [], [], []
    width = max(len(sr.block_ids) for sr in sched.scheduled)
    tables = np.zeros((len(sched.scheduled), width), np.int32)
    for i, sr in enumerate(sched.scheduled):
        req, start, n = sr.request, sr.num_computed_tokens, sr.num_new_tokens
        tables[i, :len(sr.block_ids)] = sr.block_ids
        for p in range(start, start + n):
            known = p < req.num_tokens
            ids.append(req.all_token_ids[p] if known else 0)
            if not known:
                pending.append((len(pos), last_sampled[req.request_id]))
            pos.append(p)
            slots.append(sr.block_ids[p // BLOCK] * BLOCK + p % BLOCK)
        if req.sampling_params.prompt_logprobs is not None:
            last = min(start + n, req.num_prompt_tokens - 1)
            prompt_rows += [cu[-1] + j for j in range(max(0, last - start))]
        cu.append(cu[-1] + n)
        seq_lens.append(start + n)
        if sr.do_sample:
            sampled.append(cu[-1] - 1)
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, cu_seqlens_q=cu, seq_lens=seq_lens,
                block_tables=tables, logits_idx=sampled + prompt_rows, pending=pending, num_sampled=len(sampled))


def random_schedule(seed: int):
    rng = random.Random(seed)
    scheduled, last_sampled = [], {}
    for i in range(rng.randrange(1, 40)):
        prompt_len = rng.randrange(2, 300)
        params = SamplingParams(prompt_logprobs=rng.choice([None, None, 2]))
        req = Request(str(i), [rng.randrange(3, 1000) for _ in range(prompt_len)], params)
        for _ in range(rng.choice([0, 0, rng.randrange(1, 20)])):  # some outputs already
            req.append_output_token(rng.randrange(3, 1000))
        kind = rng.choice(["prefill", "chunk", "decode", "pending"])
        if kind == "pending":  # its sampled token is still on the device
            req.num_output_placeholders = 1
            last_sampled[req.request_id] = rng.randrange(64)
            start, n = req.num_tokens, 1
        elif kind == "decode":
            start, n = req.num_tokens - 1, 1
        else:
            start = 0 if kind == "prefill" else rng.randrange(0, req.num_tokens - 1)
            n = rng.randrange(1, req.num_tokens - start + 1)
        end = start + n
        blocks = rng.sample(range(1, 5000), -(-end // BLOCK) + rng.randrange(0, 3))  # spare blocks too
        do_sample = end == req.num_tokens + req.num_output_placeholders
        scheduled.append(ScheduledRequest(req, n, start, blocks, do_sample))
    return SchedulerOutput(scheduled, []), last_sampled


@pytest.mark.parametrize("seed", range(30))
def test_prepare_step_matches_reference(seed):
    sched, last_sampled = random_schedule(seed)
    runner = types.SimpleNamespace(block_size=BLOCK, dispatcher=CudaGraphDispatcher((1, 2, 4, 8), (8, 16)),
                                   last_sampled=(None, last_sampled))
    runner._num_prompt_logprob_rows = ModelRunner._num_prompt_logprob_rows
    step = ModelRunner.prepare_step(runner, sched)
    want, b = reference(sched, last_sampled), step.batch
    for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "logits_idx"):
        got = getattr(b, name)
        np.testing.assert_array_equal(got, np.asarray(want[name], dtype=got.dtype), err_msg=name)
    assert b.input_ids.dtype == np.int64 and b.cu_seqlens_q.dtype == np.int32 and b.seq_lens.dtype == np.int32
    np.testing.assert_array_equal(b.block_tables, want["block_tables"])
    assert b.max_query_len == max(sr.num_new_tokens for sr in sched.scheduled)
    assert step.num_sampled == want["num_sampled"]
    pending = list(zip(step.pending_rows.tolist(), step.pending_src.tolist())) if step.pending_rows is not None else []
    assert pending == want["pending"]


def test_pending_token_without_a_source_is_an_error():
    """A decode of a token that is neither known nor in the last step's output names the request."""
    sched, last_sampled = random_schedule(0)
    req = Request("lost", [5, 6, 7], SamplingParams())
    req.num_output_placeholders = 1
    sched.scheduled.append(ScheduledRequest(req, 1, req.num_tokens, [1], True))
    runner = types.SimpleNamespace(block_size=BLOCK, dispatcher=CudaGraphDispatcher((1, 2, 4, 8), (8, 16)),
                                   last_sampled=(None, last_sampled))
    runner._num_prompt_logprob_rows = ModelRunner._num_prompt_logprob_rows
    with pytest.raises(RuntimeError, match="'lost'"):
        ModelRunner.prepare_step(runner, sched)
