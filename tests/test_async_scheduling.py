"""Async scheduling (step N+1 launched before step N's tokens reach the host) on CPU.

The reference is the synchronous engine: the same tiny random-weight model (2 layers of
SmolLM2-135M's shape, same seed) must give identical tokens, texts and logprobs, and the
scheduler driven with a one-step lag must give the same tokens as the synchronous loop.
"""

import pytest

from compilelm import LLM, SamplingParams
from compilelm.config import SchedulerConfig
from compilelm.runtime.kv_cache_manager import KVCacheManager
from compilelm.runtime.request import Request, RequestStatus
from compilelm.runtime.scheduler import Scheduler

TINY = dict(model_overrides={"num_hidden_layers": 2}, max_model_len=256, num_kv_blocks=64,
            enforce_eager=True, max_num_batched_tokens=32)


def _greedy(n=8, **kw):
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def engines():
    """(sync, async) engines over the same weights."""
    return tuple(LLM("dummy:smollm2-135m", async_scheduling=a, **TINY).engine for a in (False, True))


def _run(engine, requests, abort_at=None, late=None):
    """Adds `requests` [(id, prompt, params)], steps to the end; returns {id: last RequestOutput}.
    `abort_at` = (id, n): abort it once an output with n tokens was seen. `late` = (step, requests):
    added after that many steps. Also returns the number of forward calls."""
    calls = []
    run_step = engine.model_runner.run_step
    engine.model_runner.run_step = lambda step: (calls.append(1), run_step(step))[1]
    try:
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        last, n = {}, 0
        while engine.has_unfinished_requests():
            if late is not None and n == late[0]:
                for rid, prompt, params in late[1]:
                    engine.add_request(rid, prompt, params)
            for out in engine.step():
                last[out.request_id] = out
                if abort_at and out.request_id == abort_at[0] and len(out.outputs[0].token_ids) >= abort_at[1]:
                    engine.abort_request(out.request_id)
            n += 1
            assert n < 500
    finally:
        del engine.model_runner.run_step
    assert engine.kv_cache_manager.usage == 0.0
    return last, len(calls)


def _summary(out):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [{t: (round(lp.logprob, 4), lp.rank) for t, lp in e.items()}
                                              for e in c.logprobs])
            for c in out.outputs], out.prompt_logprobs is not None


def _same(engines, requests, **kw):
    (sync, _), (asyn, _) = (_run(e, requests, **kw) for e in engines)
    assert sync.keys() == asyn.keys()
    for rid in sync:
        assert _summary(asyn[rid]) == _summary(sync[rid]), rid
    return sync


def test_mixed_workload_matches_sync(engines):
    sync_engine = engines[0]
    ref = _run(sync_engine, [("ref", [40, 41], _greedy(12)), ("eos", [7, 8, 9], _greedy(10))])[0]
    text, eos_ref = ref["ref"].outputs[0].text, ref["eos"].outputs[0].token_ids
    words = text.split()
    if len(words) < 4:
        pytest.skip("random model produced too little text to pick a stop string")
    stop = words[3]  # hit a few tokens in
    shared = list(range(300, 340))  # 2.5 blocks of 16: a later request hits the first two
    requests = [
        ("long", list(range(100, 170)), _greedy(12)),  # chunked: 70 tokens in a 32-token budget
        ("short", [5, 6, 7], _greedy(3)),
        ("seeded", [1, 2, 3], SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=9,
                                             ignore_eos=True, logprobs=2)),
        ("seeded_plain", [4, 5, 6], SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=9, ignore_eos=True)),
        ("stopstr", [40, 41], _greedy(12, stop=[stop])),
        ("stopid", [7, 8, 9], _greedy(10, stop_token_ids=[eos_ref[3]])),
        ("plp", list(range(60, 80)), _greedy(4, prompt_logprobs=1)),
        ("abort", [11, 12, 13, 14], _greedy(30)),
        ("shared0", shared, _greedy(6)),
    ]
    late = (3, [("shared1", shared[:32] + [9, 9, 9], _greedy(6))])
    out = _same(engines, requests, abort_at=("abort", 4), late=late)
    assert out["stopid"].outputs[0].finish_reason == "stop"
    assert out["stopstr"].outputs[0].stop_reason == stop and out["stopstr"].outputs[0].text
    assert len(out["long"].outputs[0].token_ids) == 12
    assert len(out["abort"].outputs[0].token_ids) == 4 and not out["abort"].finished
    assert out["shared1"].num_cached_tokens == 32


def test_forced_eos_matches_sync(engines):
    ref = _run(engines[0], [("r", [21, 22, 23], _greedy(10))])[0]["r"].outputs[0].token_ids
    eos = ref[4]
    saved = [e.eos_token_id for e in engines]
    try:
        for e in engines:
            e.eos_token_id = eos
        out = _same(engines, [("r", [21, 22, 23], _greedy(10, ignore_eos=False)),
                              ("other", [30, 31], _greedy(10, ignore_eos=False))])
    finally:
        for e, s in zip(engines, saved):
            e.eos_token_id = s
    assert out["r"].outputs[0].token_ids == ref[:ref.index(eos) + 1]
    assert out["r"].outputs[0].finish_reason == "stop"


def test_forward_calls(engines):
    sync, asyn = engines
    req = [("r", [1, 2, 3, 4, 5], _greedy(6))]
    # max_tokens: the in-flight last token is known to end it, so no extra step
    assert _run(sync, req)[1] == _run(asyn, req)[1] == 6
    ref = _run(sync, req)[0]["r"].outputs[0].token_ids
    stop = [("r", [1, 2, 3, 4, 5], _greedy(6, stop_token_ids=[ref[2]]))]
    first = ref.index(ref[2])
    # a stop token is only seen after the next step is launched: one dropped step
    assert _run(sync, stop)[1] == first + 1
    out, calls = _run(asyn, stop)
    assert calls == first + 2 and out["r"].outputs[0].token_ids == ref[:first + 1]


def test_step_returns_previous_step_and_drains(engines):
    asyn = engines[1]
    asyn.add_request("a", [3, 4, 5], _greedy(5))
    assert asyn.step() == []  # step 0 launched, nothing processed yet
    outs = asyn.step()  # step 1 launched, step 0 processed
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    asyn.abort_request("a")
    assert asyn.has_unfinished_requests()  # step 1 still in flight
    assert asyn.step() == []  # drained: its token dropped
    assert not asyn.has_unfinished_requests() and asyn.kv_cache_manager.usage == 0.0


def test_penalties_and_logits_processors_match_sync(engines):
    seen = {False: [], True: []}

    def processor(mode):
        def fn(output_token_ids, logits):
            seen[mode].append(list(output_token_ids))
            logits[output_token_ids[-1] if output_token_ids else 0] -= 5.0
            return logits
        return fn

    results = []
    for mode, engine in zip((False, True), engines):
        requests = [("pen", [50, 51, 52], _greedy(8, repetition_penalty=1.5, frequency_penalty=0.5)),
                    ("proc", [60, 61], _greedy(7, logits_processors=[processor(mode)])),
                    ("min", [70, 71], _greedy(6, min_tokens=4, stop_token_ids=[0])),
                    ("plain", [80, 81, 82], _greedy(9))]
        results.append({k: _summary(v) for k, v in _run(engine, requests)[0].items()})
    assert results[0] == results[1]
    # the processor saw every previous token on the host, in both modes
    assert seen[True] == seen[False] == [seen[False][-1][:i] for i in range(7)]


def test_preemption_matches_sync():
    kw = dict(TINY, max_model_len=64, num_kv_blocks=7)  # 6 usable blocks = 96 tokens
    sync, asyn = (LLM("dummy:smollm2-135m", async_scheduling=a, **kw).engine for a in (False, True))
    requests = [(str(i), list(range(10 * i, 10 * i + 14)), _greedy(40)) for i in range(4)]
    _same((sync, asyn), requests)
    assert sync.scheduler.num_preemptions > 0 and asyn.scheduler.num_preemptions > 0


# -- the scheduler alone, driven with a one-step lag ------------------------------------------------

def _position_model(request, position):
    """Fake model: the token at `position` depends only on the prompt and the position."""
    return 100 + (request.prompt_token_ids[0] * 7 + position * 13) % 50


def _drive(sched, lag: bool, max_steps=200):
    """Runs the scheduler to the end; with `lag`, step N+1 is scheduled before N's update."""
    in_flight, plans = None, []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and in_flight is None:
            return plans
        out = sched.schedule()
        plans.append([(s.request.request_id, s.num_new_tokens, s.num_computed_tokens, s.do_sample)
                      for s in out.scheduled])
        # the token sampled by a row at position p is the token at p + 1
        sampled = {s.request.request_id: _position_model(s.request, s.num_computed_tokens + s.num_new_tokens)
                   for s in out.scheduled if s.do_sample}
        if not lag:
            sched.update_from_output(out, sampled)
            continue
        if in_flight is not None:
            sched.update_from_output(*in_flight)
        in_flight = (out, sampled) if out.scheduled else None
    raise AssertionError("did not finish")


def _scheduler(num_blocks=64, caching=False, **kw):
    kw.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**kw), KVCacheManager(4, num_blocks, caching))


def _add(sched, rid, prompt, **params):
    params.setdefault("max_tokens", 6)
    eos = params.pop("eos", None)
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_id=eos)
    sched.add_request(r)
    return r


def test_scheduler_plan_with_lag():
    sched = _scheduler()
    r = _add(sched, "r", [1, 2, 3, 4], max_tokens=3)
    assert _drive(sched, lag=True) == [
        [("r", 4, 0, True)],
        [("r", 1, 4, True)],  # decodes the token still in flight (position 4)
        [("r", 1, 5, True)],
        [],  # the in-flight token is the 3rd: nothing to schedule, step 2 drains
    ]
    assert r.output_token_ids == [_position_model(r, p) for p in (4, 5, 6)]
    assert r.num_output_placeholders == 0 and r.status is RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("case", ["chunked", "preempt", "prefix", "stop"])
def test_scheduler_lag_matches_sync(case):
    outs = []
    for lag in (False, True):
        if case == "preempt":
            sched = _scheduler(num_blocks=6)  # 5 usable blocks of 4
        else:
            sched = _scheduler(caching=case == "prefix", max_num_batched_tokens=6)
        reqs = [_add(sched, str(i), range(10 * i + 1, 10 * i + 6 + i), max_tokens=5 + i) for i in range(3)]
        if case == "prefix":
            reqs.append(_add(sched, "p", range(1, 9)))
        if case == "stop":  # tokens 147, 110 (stop id), 123: the in-flight third one is dropped
            reqs.append(_add(sched, "s", [3, 3], stop_token_ids=[110]))
            reqs.append(_add(sched, "e", [3, 3], eos=110, min_tokens=3))  # eos only from the 3rd token
        _drive(sched, lag)
        outs.append([(r.output_token_ids, r.status, r.num_output_placeholders) for r in reqs])
        assert sched.kv_cache_manager.usage == 0.0
        if case == "preempt":
            assert sched.num_preemptions > 0
    assert outs[0] == outs[1]
    if case == "stop":
        assert outs[1][-2][0] == [147, 110] and outs[1][-1][0][:2] == [147, 110]


def test_config_flag():
    import argparse

    from compilelm.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags, expected in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        config = engine_config_from_args(parser.parse_args(["dummy:smollm2-135m", *flags]))
        assert (config.scheduler.async_scheduling if config.scheduler else None) is expected
    # CPU: off unless asked for
    assert LLM("dummy:smollm2-135m", **dict(TINY, max_num_batched_tokens=64)).engine.async_scheduling is False
    # (any tensor_parallel_size may schedule asynchronously: tests/test_tensor_parallel.py)
