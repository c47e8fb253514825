"""AsyncLLMEngine on a tiny dummy engine (no HTTP): requests from concurrent callers share
engine steps, a closed stream aborts its request and frees its blocks, admission is bounded,
and a failing step fails every caller instead of hanging it."""

from __future__ import annotations

import asyncio

import pytest

from compilelm.llm import make_engine_config
from compilelm.runtime.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from compilelm.runtime.engine import LLMEngine
from compilelm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    config = make_engine_config("dummy:smollm2-135m", model_overrides={"num_hidden_layers": 2},
                                max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
                                enforce_eager=True)
    return LLMEngine(config)


@pytest.fixture
def async_engine(engine):
    ae = AsyncLLMEngine(lambda: engine, max_queue_len=0)
    ae.start()
    assert ae.wait_ready(60) and ae.is_ready
    yield ae
    ae.shutdown()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _collect(ae, rid, prompt, params):
    last = None
    async for out in ae.generate(rid, prompt, params):
        last = out
    return last


def test_concurrent_callers_share_steps(async_engine, engine):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    alone = [engine_out.outputs[0].token_ids for engine_out in
             [asyncio.run(_collect(async_engine, f"solo{i}", p, _greedy(12)))
              for i, p in enumerate(prompts)]]
    steps = 0
    step = engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counting_step
    try:
        async def together():
            return await asyncio.gather(*[_collect(async_engine, f"r{i}", p, _greedy(12))
                                          for i, p in enumerate(prompts)])
        outs = asyncio.run(together())
    finally:
        del engine.step
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(o.finished and len(o.outputs[0].token_ids) == 12 for o in outs)
    assert steps <= 12 + 3  # batched: about one step per token, not 4 x 12


def test_closing_a_stream_aborts_and_frees_blocks(async_engine):
    async def start_then_leave():
        stream = async_engine.generate("long", [5, 6, 7], _greedy(100))
        seen = 0
        async for out in stream:
            seen = len(out.outputs[0].token_ids)
            if seen >= 2:
                break
        stream.close()
        assert async_engine.num_seqs_in_flight == 0
        for _ in range(200):  # the engine thread applies the abort between steps
            stats = async_engine.stats
            if stats["num_running"] == 0 and stats["kv_cache_usage"] == 0:
                return seen
            await asyncio.sleep(0.02)
        raise AssertionError(f"request still held: {async_engine.stats}")

    assert asyncio.run(start_then_leave()) < 100


def test_admission_is_bounded(async_engine):
    async def run():
        first = async_engine.generate("a", [5, 6], _greedy(3))
        with pytest.raises(QueueFullError):  # max_num_seqs 4 + max_queue_len 0
            async_engine.generate("b", [5, 6], SamplingParams(n=4, max_tokens=3))
        async for _ in first:
            pass
        return await _collect(async_engine, "c", [5, 6], SamplingParams(n=4, max_tokens=3))

    out = asyncio.run(run())
    assert len(out.outputs) == 4 and out.finished


def test_bad_prompt_fails_only_that_request(async_engine):
    async def run():
        with pytest.raises(ValueError, match="out of vocabulary"):
            await _collect(async_engine, "bad", [10**9], _greedy(2))
        return await _collect(async_engine, "good", [5], _greedy(2))

    assert asyncio.run(run()).finished


def test_step_failure_fails_callers_and_stays_dead(engine):
    ae = AsyncLLMEngine(lambda: engine)
    ae.start()
    ae.wait_ready(60)
    step = engine.step
    calls = 0

    def failing_step():
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("injected")
        return step()

    engine.step = failing_step
    try:
        async def run():
            results = await asyncio.gather(
                *[_collect(ae, f"d{i}", [5, 6], _greedy(50)) for i in range(3)],
                return_exceptions=True)
            assert all(isinstance(r, EngineDeadError) and "injected" in str(r) for r in results)
            with pytest.raises(EngineDeadError):
                ae.generate("after", [5], _greedy(1))

        asyncio.run(asyncio.wait_for(run(), 60))
        assert ae.errored
    finally:
        del engine.step
        engine.abort_request([f"d{i}" for i in range(3)])
        ae.shutdown()
