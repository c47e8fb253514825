"""Scheduler: multi-step scenarios driven by a fake model, compared with hand-computed schedules.

A plan entry is (request_id, num_new_tokens, num_computed_tokens, do_sample); block size is 4.
"""

import pytest

from compilelm.config import SchedulerConfig
from compilelm.runtime.kv_cache_manager import KVCacheManager
from compilelm.runtime.request import Request, RequestStatus
from compilelm.runtime.scheduler import Scheduler
from compilelm.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=64, caching=False, **config):
    config.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(BS, num_blocks, caching))


def add(sched, rid, prompt, eos=None, **params):
    params.setdefault("max_tokens", 32)
    request = Request(rid, list(prompt), SamplingParams(**params), eos_token_id=eos)
    sched.add_request(request)
    return request


def counting_model(request):
    """Fake model: the n-th output token of every request is 1000 + n, whatever was preempted."""
    return 1000 + request.num_output_tokens


def step(sched, model=counting_model, with_blocks=False):
    out = sched.schedule()
    assert out.num_scheduled_tokens <= sched.config.max_num_batched_tokens
    plan = [
        (s.request.request_id, s.num_new_tokens, s.num_computed_tokens, s.do_sample)
        + ((s.block_ids.tolist(),) if with_blocks else ())
        for s in out.scheduled
    ]
    sampled = {s.request.request_id: model(s.request) for s in out.scheduled if s.do_sample}
    got = sched.update_from_output(out, sampled)
    assert [r.request_id for r in got] == list(sampled)
    return plan


def test_chunked_prefill_within_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = add(sched, "a", range(20))
    add(sched, "b", range(100, 106))
    assert [step(sched) for _ in range(5)] == [
        [("a", 8, 0, False)],  # budget used up, b waits
        [("a", 8, 8, False)],
        [("a", 4, 16, True), ("b", 4, 0, False)],  # b's prompt chunked to the 4 left
        [("a", 1, 20, True), ("b", 2, 4, True)],
        [("a", 1, 21, True), ("b", 1, 6, True)],
    ]
    assert a.output_token_ids == [1000, 1001, 1002]


def test_running_decodes_fill_budget_before_admission():
    sched = make_scheduler(max_num_batched_tokens=3)
    for rid in "abc":
        add(sched, rid, [1], max_tokens=2)
    add(sched, "d", [2])
    assert [step(sched) for _ in range(3)] == [
        [("a", 1, 0, True), ("b", 1, 0, True), ("c", 1, 0, True)],
        [("a", 1, 1, True), ("b", 1, 1, True), ("c", 1, 1, True)],
        [("d", 1, 0, True)],
    ]


def test_no_chunking_admits_whole_prompts_only_in_fcfs_order():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False)
    add(sched, "a", range(6))
    add(sched, "b", range(4))
    add(sched, "c", [7])  # would fit in step 0, but b is ahead of it
    assert [step(sched) for _ in range(2)] == [
        [("a", 6, 0, True)],
        [("a", 1, 6, True), ("b", 4, 0, True), ("c", 1, 0, True)],
    ]


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    add(sched, "a", range(3), max_tokens=1)
    add(sched, "b", range(3), max_tokens=3)
    add(sched, "c", range(3), max_tokens=1)
    assert step(sched) == [("a", 3, 0, True), ("b", 3, 0, True)]
    assert (sched.num_running, sched.num_waiting) == (1, 1)  # a finished
    assert step(sched) == [("b", 1, 3, True), ("c", 3, 0, True)]


def test_fcfs_stops_at_first_request_without_blocks():
    sched = make_scheduler(num_blocks=4)  # 3 usable blocks
    add(sched, "a", range(8), max_tokens=1)  # 2 blocks
    add(sched, "b", range(8))  # 2 blocks: does not fit next to a
    add(sched, "c", range(2))  # 1 block would fit, but must not overtake b
    assert step(sched) == [("a", 8, 0, True)]
    assert step(sched) == [("b", 8, 0, True), ("c", 2, 0, True)]


def test_preemption_latest_first_and_recompute():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=7)
    b = add(sched, "b", [5, 6, 7, 8], max_tokens=7)
    c = add(sched, "c", [9, 10, 11, 12], max_tokens=2)
    plans = [step(sched, with_blocks=True) for _ in range(10)]
    assert plans == [
        [("a", 4, 0, True, [1]), ("b", 4, 0, True, [2]), ("c", 4, 0, True, [3])],
        # a takes the last free block; b needs one too -> c (latest) preempted, b gets block 3
        [("a", 1, 4, True, [1, 4]), ("b", 1, 4, True, [2, 3])],
        [("a", 1, 5, True, [1, 4]), ("b", 1, 5, True, [2, 3])],  # c needs 2 blocks, 0 free
        [("a", 1, 6, True, [1, 4]), ("b", 1, 6, True, [2, 3])],
        [("a", 1, 7, True, [1, 4]), ("b", 1, 7, True, [2, 3])],
        # a needs a third block -> b preempted (freed tail first: 3, 2)
        [("a", 1, 8, True, [1, 4, 3])],
        [("a", 1, 9, True, [1, 4, 3])],  # b (9 tokens, 3 blocks) does not fit in 1; c not tried
        # a finished and freed 3, 4, 1; b recomputes prompt + 5 outputs; c still waits
        [("b", 9, 0, True, [2, 3, 4])],
        [("b", 1, 9, True, [2, 3, 4])],
        [("c", 5, 0, True, [1, 4])],  # c recomputes prompt + 1 output
    ]
    assert not sched.has_unfinished_requests()
    assert a.output_token_ids == b.output_token_ids == [1000 + i for i in range(7)]
    assert c.output_token_ids == [1000, 1001]
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 1, 1)
    assert sched.num_preemptions == 2
    assert sched.kv_cache_manager.usage == 0.0


def test_preempted_state_and_queue_front():
    sched = make_scheduler(num_blocks=3)  # 2 usable blocks
    a = add(sched, "a", range(4))
    b = add(sched, "b", range(10, 14))
    add(sched, "c", [1])
    step(sched)  # a, b prefill; c has no block
    out = sched.schedule()  # a preempts b
    assert out.preempted_request_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.all_token_ids == list(range(10, 14)) + [1000]
    assert [s.request for s in out.scheduled] == [a]


def test_no_admission_in_a_step_that_preempted():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=5)  # 3 usable blocks
    add(sched, "a", range(3))
    add(sched, "b", range(10, 16))
    assert [step(sched, with_blocks=True) for _ in range(4)] == [
        [("a", 3, 0, True, [1]), ("b", 2, 0, False, [2])],
        [("a", 1, 3, True, [1]), ("b", 4, 2, True, [2, 3])],
        # a needs a second block: b preempted (frees 3, 2), a takes 3. A 4-token chunk of b
        # would fit in block 2, but nothing is admitted in a step that had to preempt.
        [("a", 1, 4, True, [1, 3])],
        [("a", 1, 5, True, [1, 3]), ("b", 4, 0, False, [2])],  # b resumes, chunked
    ]


def test_running_request_preempts_itself_when_alone():
    sched = make_scheduler(num_blocks=3)  # 2 usable blocks = 8 tokens
    r = add(sched, "r", range(8))
    assert step(sched) == [("r", 8, 0, True)]
    out = sched.schedule()  # token 8 needs a third block: nobody else to preempt
    assert out.scheduled == [] and out.preempted_request_ids == ["r"]
    assert r.status is RequestStatus.PREEMPTED and sched.kv_cache_manager.usage == 0.0


def test_prefix_cache_hit_through_scheduler():
    sched = make_scheduler(caching=True)
    a = add(sched, "a", range(10))
    assert step(sched, with_blocks=True) == [("a", 10, 0, True, [1, 2, 3])]
    b = add(sched, "b", list(range(8)) + [50, 51])
    assert step(sched, with_blocks=True) == [
        ("a", 1, 10, True, [1, 2, 3]),
        ("b", 2, 8, True, [1, 2, 4]),  # first two blocks shared
    ]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    stats = sched.kv_cache_manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (20, 8)


def test_resumed_request_reuses_its_cached_head_blocks():
    sched = make_scheduler(num_blocks=6, caching=True)  # 5 usable blocks
    add(sched, "a", range(8), max_tokens=2)
    b = add(sched, "b", range(100, 108))
    assert step(sched, with_blocks=True) == [("a", 8, 0, True, [1, 2]), ("b", 8, 0, True, [3, 4])]
    # a takes block 5; b needs a block, is the latest, and preempts itself.
    assert step(sched, with_blocks=True) == [("a", 1, 8, True, [1, 2, 5])]
    # a finished. b's full blocks are still cached: only its last token is recomputed.
    assert step(sched, with_blocks=True) == [("b", 1, 8, True, [3, 4, 5])]
    assert b.num_cached_tokens == 0  # the first schedule was a miss


def test_finished_requests_free_blocks():
    sched = make_scheduler(num_blocks=16, caching=True)
    for i in range(3):
        add(sched, str(i), range(i, i + 7), max_tokens=3 + i)
    n = 0
    while sched.has_unfinished_requests():
        step(sched)
        n += 1
    assert n == 5
    assert sched.kv_cache_manager.usage == 0.0
    assert sched.kv_cache_manager.req_to_blocks == {}
    assert (sched.num_running, sched.num_waiting) == (0, 0)


def scripted(tokens):
    return lambda request: tokens[request.num_output_tokens]


def run_to_end(sched, model, max_steps=50):
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched, model)
    raise AssertionError("did not finish")


STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize(
    "params, eos, tokens, expected_output, status, stop_reason",
    [
        ({}, 2, [5, 2, 5], [5, 2], STOPPED, None),
        ({}, None, [5, 2, 5], [5, 2, 5], LENGTH, None),  # no eos id
        ({"ignore_eos": True}, 2, [5, 2, 2], [5, 2, 2], LENGTH, None),
        ({"min_tokens": 3}, 2, [2, 2, 2], [2, 2, 2], STOPPED, None),
        ({"min_tokens": 2}, 2, [2, 2, 5], [2, 2], STOPPED, None),
        ({"min_tokens": 3}, 2, [2, 5, 5], [2, 5, 5], LENGTH, None),
        ({}, 2, [5, 5, 2], [5, 5, 2], STOPPED, None),  # eos at max_tokens: "stop"
        ({"stop_token_ids": [7]}, 2, [5, 7, 5], [5, 7], STOPPED, 7),
        ({"stop_token_ids": [7], "min_tokens": 2}, None, [7, 7, 5], [7, 7], STOPPED, 7),
        ({"stop_token_ids": [7], "min_tokens": 3}, None, [7, 7, 5], [7, 7, 5], LENGTH, None),
        ({"max_tokens": 1}, 2, [5, 5, 5], [5], LENGTH, None),
    ],
)
def test_stop_conditions(params, eos, tokens, expected_output, status, stop_reason):
    params.setdefault("max_tokens", 3)
    sched = make_scheduler()
    r = add(sched, "r", range(4), eos=eos, **params)
    run_to_end(sched, scripted(tokens))
    assert r.output_token_ids == expected_output
    assert r.status is status
    assert r.finish_reason == ("stop" if status is STOPPED else "length")
    assert r.stop_reason == stop_reason
    assert sched.kv_cache_manager.usage == 0.0


def test_max_model_len_stops_generation():
    sched = make_scheduler(max_model_len=10)
    r = add(sched, "r", range(7), max_tokens=None)
    run_to_end(sched, counting_model)
    assert r.num_tokens == 10 and r.num_output_tokens == 3
    assert r.status is RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"


def test_abort_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    a = add(sched, "a", range(5))
    b = add(sched, "b", range(5))
    step(sched)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert b.status is RequestStatus.FINISHED_ABORTED and b.finish_reason == "abort"
    assert sched.num_waiting == 0 and sched.num_running == 1
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert a.finish_reason == "abort" and sched.num_running == 0
    assert sched.kv_cache_manager.usage == 0.0 and not sched.has_unfinished_requests()
    sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)  # no-op
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_stop_from_outside_between_schedule_and_update():
    sched = make_scheduler()
    r = add(sched, "r", range(5))
    out = sched.schedule()
    sched.finish_requests("r", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    assert sched.update_from_output(out, {"r": 9}) == []
    assert r.output_token_ids == [] and r.finish_reason == "stop"
    assert sched.kv_cache_manager.usage == 0.0


def test_add_request_rejects_empty_and_duplicate():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="prompt_token_ids"):
        add(sched, "r", [])
    add(sched, "r", [1])
    with pytest.raises(ValueError, match="request_id"):
        add(sched, "r", [2])




@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 0}, "max_model_len"),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 100, "max_model_len": 200},
            "max_num_batched_tokens",
        ),
    ],
)
def test_scheduler_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)
