"""Tensor parallelism on CPU (gloo, one process per rank): the parallel layers against plain torch
on the same full weights, the all-reduce + add + RMSNorm fusion against eager, and whole engines
at tensor_parallel_size 2 against tensor_parallel_size 1 (greedy tokens and logprobs)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from compilelm.distributed.parallel_state import destroy_distributed, get_tp_rank, init_distributed
from compilelm.layers.layernorm import RMSNorm
from compilelm.ops import collectives as comm
from compilelm.ops.norm import rms_norm
from compilelm.passes.debug.testing import check_pass
from compilelm.passes.fusion.fuse_allreduce_rms import AllReduceRMSNormFusionPass
from compilelm.sampling_params import SamplingParams

ops = torch.ops.compilelm


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layers_rank(rank: int, world: int, port: int, failures) -> None:
    """Each parallel layer, built on this rank and loaded from the full weights, reproduces the
    replicated computation."""
    try:
        init_distributed(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
        from compilelm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
        from compilelm.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
            compute_logits,
        )
        g = torch.Generator().manual_seed(0)  # the same full weights and inputs on every rank
        x = torch.randn(5, 32, generator=g)
        w_col, w_row, b_row = (torch.randn(48, 32, generator=g), torch.randn(32, 48, generator=g),
                               torch.randn(32, generator=g))
        emb = torch.randn(37, 32, generator=g)  # 37 rows: not divisible by 2 -> a padded last shard
        ids = torch.tensor([0, 18, 19, 36, 5])
        wq, wk, wv = (torch.randn(n * 8, 32, generator=g) for n in (4, 1, 1))  # 4 heads, 1 KV head

        col = ColumnParallelLinear(32, 48)
        col.weight_loader(col.weight, w_col)
        row = RowParallelLinear(48, 32, bias=True)
        row.weight_loader(row.weight, w_row)
        row.weight_loader(row.bias, b_row)
        y = col(x)  # [5, 48 / world]: this rank's columns
        torch.testing.assert_close(comm.tensor_model_parallel_all_gather(y), x @ w_col.T)
        torch.testing.assert_close(row(y), F.linear(x @ w_col.T, w_row, b_row), atol=1e-4, rtol=1e-4)

        qkv = QKVParallelLinear(32, 8, 4, 1)  # the KV head is replicated on both ranks
        for name, w in (("q", wq), ("k", wk), ("v", wv)):
            qkv.weight_loader(qkv.weight, w, name)
        q, k, v = qkv(x).split([qkv.num_heads * 8, 8, 8], dim=-1)
        torch.testing.assert_close(q, (x @ wq.T)[:, rank * 16:(rank + 1) * 16])
        torch.testing.assert_close(k, x @ wk.T)
        torch.testing.assert_close(v, x @ wv.T)

        e = VocabParallelEmbedding(37, 32)
        e.weight_loader(e.weight, emb)
        torch.testing.assert_close(e(ids), emb[ids])
        head = ParallelLMHead(37, 32)
        head.load_full(head.weight, emb)
        torch.testing.assert_close(compute_logits(x, head), x @ emb.T, atol=1e-5, rtol=1e-5)
        # a full decode graph's form: gathered logits into a static buffer, and their argmax
        buf, argmax = torch.full((7, 37), 3.0), torch.full((7,), -1, dtype=torch.int64)
        assert compute_logits(x, head, out=buf[:5], argmax_out=argmax[:5]) is not None
        torch.testing.assert_close(buf[:5], x @ emb.T, atol=1e-5, rtol=1e-5)
        assert argmax[:5].tolist() == buf[:5].argmax(-1).tolist() and (argmax[5:] == -1).all() and (buf[5:] == 3).all()

        # the fused op == all_reduce then add + norm
        w = torch.randn(32, generator=g)
        part = torch.randn(5, 32, generator=torch.Generator().manual_seed(10 + rank))  # differs per rank
        normed, res = ops.fused_allreduce_add_rms_norm(part, x, w, 1e-6)
        total = comm.all_reduce(part)
        torch.testing.assert_close(res, total + x)
        torch.testing.assert_close(normed, rms_norm(total + x, w, 1e-6))
        assert get_tp_rank() == rank
        dist.barrier()
        if rank == 0:  # tracing the fusion's patterns on one rank must not wait for a collective
            assert AllReduceRMSNormFusionPass().patterns is not None
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        failures.put(f"rank {rank}: {exc!r}")
        raise
    finally:
        destroy_distributed()


def test_parallel_layers_match_replicated():
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_layers_rank, args=(r, 2, port, failures)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    assert not errors and all(p.exitcode == 0 for p in procs), errors or [p.exitcode for p in procs]


# -- the fusion pass on a toy graph (one rank: the all-reduce is the identity) ----------------

class ToyTPBlock(torch.nn.Module):
    """row-parallel output -> all_reduce -> add + norm, twice (as o_proj then down_proj feed the
    next norms), then a final norm whose residual output is unused."""

    def __init__(self, hidden=64, dtype=torch.float32):
        super().__init__()
        self.n1, self.n2 = RMSNorm(hidden, 1e-6).to(dtype), RMSNorm(hidden, 1e-6).to(dtype)
        self.lin = torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        for n in (self.n1, self.n2):
            n.weight.data.uniform_(0.5, 1.5)

    def forward(self, x, residual):
        h, residual = self.n1(ops.all_reduce(self.lin(x)), residual)
        h, residual = self.n2(ops.all_reduce(self.lin(h)), residual)
        return h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allreduce_rms_fusion_toy(dtype):
    block = ToyTPBlock(dtype=dtype)
    x, residual = torch.randn(6, 64, dtype=dtype), torch.randn(6, 64, dtype=dtype)
    check_pass(block, [x, residual], [AllReduceRMSNormFusionPass()],
               matches={"AllReduceRMSNormFusionPass": 2},
               ops_before={"compilelm.all_reduce.default": 2, "aten.rsqrt.default": 2},
               ops_after={"compilelm.all_reduce.default": 0, "aten.rsqrt.default": 0,
                          "compilelm.fused_allreduce_add_rms_norm.default": 2},
               atol=0.0)


def test_allreduce_rms_fusion_skips_single_rank_graphs():
    """A model at tensor_parallel_size 1 has no all-reduce: the pass leaves no record."""
    block = RMSNorm(64)
    p = AllReduceRMSNormFusionPass()
    check_pass(lambda x, r: block(x, r), [torch.randn(4, 64), torch.randn(4, 64)], [p],
               ops_after={"compilelm.fused_allreduce_add_rms_norm.default": 0})
    assert p.matches == 0


# -- whole engines: tensor_parallel_size 2 == 1 ---------------------------------------------

PROMPTS = [[11, 2, 30, 4, 500, 6, 7], [9, 99, 999], list(range(40, 80))]


def _generate(tp: int, preset: str, overrides: dict, **kw):
    from compilelm.llm import LLM
    llm = LLM(f"dummy:{preset}", model_overrides=overrides, max_model_len=128, num_kv_blocks=64,
              tensor_parallel_size=tp, **kw)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, prompt_logprobs=1, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs],
                [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs])
    finally:
        llm.engine.shutdown()


def _assert_same(a, b):
    assert a[0] == b[0], f"greedy tokens differ:\n{a[0]}\n{b[0]}"
    for x, y in zip(a[1] + a[2], b[1] + b[2]):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=2e-4, rtol=0)


QWEN3 = ("qwen3-0.6b", {"num_hidden_layers": 2, "vocab_size": 4096})
# one KV head on two ranks: replicated
LLAMA_MQA = ("llama-3.2-1b", {"num_hidden_layers": 2, "vocab_size": 3001, "num_key_value_heads": 1,
                              "hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
                              "head_dim": 64})


@pytest.mark.parametrize("model", [QWEN3, LLAMA_MQA], ids=["qwen3", "llama-mqa"])
def test_tp2_equals_tp1_eager(model):
    _assert_same(_generate(2, *model, enforce_eager=True), _generate(1, *model, enforce_eager=True))


def test_tp2_equals_tp1_with_an_fp8_kv_cache():
    """Each rank quantizes and reads its own heads' fp8 cache: the same tokens as one rank (logprobs
    within fp8's rounding: a last-bit difference of the rank sums may move a value to the next code)."""
    a, b = (_generate(tp, *QWEN3, enforce_eager=True, kv_cache_dtype="fp8") for tp in (2, 1))
    assert a[0] == b[0], f"greedy tokens differ:\n{a[0]}\n{b[0]}"
    for x, y in zip(a[1] + a[2], b[1] + b[2]):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=5e-2, rtol=0)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_tp2_equals_tp1_compiled(fuse, tmp_path):
    cc = {"passes": {"fuse_allreduce_rms": fuse}, "cache_dir": str(tmp_path / "cache")}
    _assert_same(_generate(2, *QWEN3, compilation_config=cc), _generate(1, *QWEN3, enforce_eager=True))


# -- async scheduling at tensor_parallel_size 2 -------------------------------------------------

MIXED_PROMPTS = [list(range(100, 170)), [5, 6, 7], [1, 2, 3], list(range(60, 80)), [11, 12, 13, 14]]


def _mixed_params():
    """Greedy rows (with and without logprobs) and a seeded random one: its steps make rank 0
    broadcast the sampled ids; all-greedy steps let every rank take its own argmax."""
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    return [greedy, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
            SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=7, max_tokens=9, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True), greedy]


def _run_engine(tp: int, async_scheduling: bool, prompts, params, **kw):
    """Outputs (token ids of every completion) and, on the driver, each step's share mode and
    number of pending rows; the engine's preemption count."""
    from compilelm.llm import LLM
    llm = LLM(f"dummy:{QWEN3[0]}", model_overrides=QWEN3[1], tensor_parallel_size=tp, enforce_eager=True,
              async_scheduling=async_scheduling, **kw)
    runner, steps = llm.engine.model_runner, []
    prepare = runner.prepare_step

    def spy(sched, *args, **kwargs):
        step = prepare(sched, *args, **kwargs)
        steps.append((step.share_sampled, 0 if step.pending_rows is None else len(step.pending_rows)))
        return step
    runner.prepare_step = spy
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs], steps, llm.engine.scheduler.num_preemptions
    finally:
        llm.engine.shutdown()


MIXED = dict(max_model_len=128, num_kv_blocks=64, max_num_batched_tokens=32)  # 70 tokens: chunked
PREEMPT = dict(max_model_len=64, num_kv_blocks=7)  # 6 usable blocks of 16 for 4 x 54 tokens


def test_tp2_async_matches_sync_and_tp1_mixed():
    """Async TP=2 (chunked prefill, greedy + seeded random + logprobs) == sync TP=2 for every
    token; its greedy requests == TP=1's. Both ways of sharing the sampled ids ran, with pending
    rows (rows whose input id was still on the device)."""
    params = _mixed_params()
    asyn, steps, _ = _run_engine(2, True, MIXED_PROMPTS, params, **MIXED)
    sync, sync_steps, _ = _run_engine(2, False, MIXED_PROMPTS, params, **MIXED)
    ref, _, _ = _run_engine(1, False, MIXED_PROMPTS, params, **MIXED)
    assert asyn == sync
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert [asyn[i] for i in greedy] == [ref[i] for i in greedy]
    modes = {mode for mode, pending in steps if pending}
    assert modes == {"argmax", "broadcast"}, steps
    assert all(mode is None and pending == 0 for mode, pending in sync_steps)


def test_tp2_async_matches_tp1_with_preemption():
    prompts = [list(range(10 * i, 10 * i + 14)) for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    asyn, steps, preempted = _run_engine(2, True, prompts, params, **PREEMPT)
    ref, _, _ = _run_engine(1, False, prompts, params, **PREEMPT)
    assert preempted > 0
    assert asyn == ref
    assert any(pending for _, pending in steps)


def test_tp2_sampling_that_raises_still_broadcasts_to_the_ranks():
    """Rank 0's sampling fails in a step whose ids rank 1 waits to receive: the error reaches the
    caller, and rank 1 is not left in the broadcast (it answers the next call), so the group's
    collectives stay paired and the shutdown is clean."""
    from compilelm.llm import LLM
    llm = LLM(f"dummy:{QWEN3[0]}", model_overrides=QWEN3[1], tensor_parallel_size=2, enforce_eager=True,
              async_scheduling=True, max_model_len=128, num_kv_blocks=64)
    executor, runner = llm.engine.executor, llm.engine.model_runner
    sample, proc = runner._sample, executor.procs[0]

    def failing(sched, step, *args):
        if step.share_sampled == "broadcast":
            raise ValueError("sampling failed")
        return sample(sched, step, *args)
    runner._sample = failing
    try:
        with pytest.raises(ValueError, match="sampling failed"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=1.0, seed=1), use_tqdm=False)
        executor.broadcast.send_call("num_kv_blocks", (), True)
        assert executor.conns[0].poll(60), "rank 1 is still waiting in the step's broadcast"
        assert executor._reply(1) == 64
    finally:
        llm.engine.shutdown()
    proc.join(timeout=30)
    assert proc.exitcode == 0


def test_tp2_async_structured_outputs_match_sync():
    """Constrained rows under async TP=2 (the grammar path: forward launched, the previous step's
    tokens accepted, then masks + sampling, ids broadcast to rank 1) == sync TP=2."""
    import json

    from compilelm.llm import LLM
    from compilelm.sampling_params import StructuredOutputsParams as S
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}}
    params = [SamplingParams(max_tokens=24, temperature=0, structured_outputs=S(json=schema)),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, structured_outputs=S(regex="[ab]{3,6}"))]
    results = []
    for async_scheduling in (True, False):
        llm = LLM("dummy:smollm2-135m", tensor_parallel_size=2, enforce_eager=True, async_scheduling=async_scheduling,
                  model_overrides={"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                                   "head_dim": 64}, max_model_len=128, num_kv_blocks=64)
        try:
            outs = llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], params, use_tqdm=False)
            results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs])
        finally:
            llm.engine.shutdown()
    assert results[0] == results[1]
    (_, text, reason), _, (_, regex_text, _) = results[0]
    if reason == "stop":  # (a random model may spend its 24 tokens on the whitespace JSON allows)
        assert 0 <= json.loads(text)["n"] <= 999
    assert 3 <= len(regex_text) <= 6 and set(regex_text) <= {"a", "b"}


def test_rank_that_exits_mid_generation_is_an_error_at_the_driver():
    """A rank killed between steps: the next step raises at the driver (no hang)."""
    import time

    from compilelm.llm import LLM
    llm = LLM(f"dummy:{QWEN3[0]}", model_overrides=QWEN3[1], tensor_parallel_size=2, enforce_eager=True,
              async_scheduling=True, max_model_len=128, num_kv_blocks=64)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        proc = llm.engine.executor.procs[0]
        proc.kill()
        proc.join(timeout=30)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
        assert time.perf_counter() - t0 < 60
    finally:
        llm.engine.shutdown()


def test_tp2_compile_reports_one_fusion_per_norm(tmp_path):
    """`compilelm compile -tp 2`'s path: every rank compiles; the all-reduce fusion matches every
    norm that follows an all-reduce: 2 per layer (the first layer's input norm follows the
    embedding's all-reduce without an add) -> 2 * layers - 1 + the final norm = 2 * layers."""
    import dataclasses

    from compilelm.llm import make_engine_config
    from compilelm.runtime.executor import Executor
    config = make_engine_config("dummy:qwen3-0.6b", model_overrides={**QWEN3[1], "num_hidden_layers": 3},
                                tensor_parallel_size=2, max_model_len=128,
                                compilation_config={"cache_dir": str(tmp_path / "cache")})
    config = dataclasses.replace(config, compilation=dataclasses.replace(config.compilation,
                                                                         dump_dir=str(tmp_path / "dump")))
    executor = Executor(config)
    try:
        reports = executor.collective_rpc("compile_model")
    finally:
        executor.shutdown()
    for report in reports:
        matches = {p["pass"]: p["matches"] for p in report["passes"]}
        assert matches["AllReduceRMSNormFusionPass"] == 6, matches
        assert matches["RopeAttentionFusionPass"] == 3, matches
    assert (tmp_path / "dump" / "report.md").exists() and (tmp_path / "dump" / "rank1" / "report.md").exists()


def test_tp_size_that_does_not_split_the_model_names_the_flag(capsys):
    from compilelm.entrypoints.cli import main
    rc = main(["generate", "hi", "--model", "dummy:smollm2-135m", "--tensor-parallel-size", "2", "--enforce-eager"])
    err = capsys.readouterr().err
    assert rc == 2 and "--tensor-parallel-size" in err and "9 attention heads" in err, err


def test_failed_rank_reports_then_leaves_the_group_with_the_driver():
    """A rank whose call raised sends its traceback, answers later calls with an error instead
    of hanging the driver, and leaves the process group only at the driver's shutdown (NCCL's
    teardown waits for every rank): its process then exits cleanly."""
    from compilelm.llm import make_engine_config
    from compilelm.runtime.executor import Executor
    config = make_engine_config("dummy:qwen3-0.6b", model_overrides=QWEN3[1], tensor_parallel_size=2,
                                max_model_len=128, enforce_eager=True)
    executor = Executor(config)
    proc = executor.procs[0]
    try:
        executor.broadcast.send_call("no_such_method", (), True)
        with pytest.raises(RuntimeError, match="(?s)rank 1 failed:.*no_such_method"):
            executor._reply(1)
        executor.broadcast.send_call("num_kv_blocks", (), True)
        with pytest.raises(RuntimeError, match="failed earlier"):
            executor._reply(1)
        assert proc.is_alive()  # still in the group, waiting for the driver's shutdown
    finally:
        executor.shutdown()
    proc.join(timeout=30)
    assert proc.exitcode == 0


def test_rank_that_raises_in_a_step_is_an_error_at_the_driver():
    """Rank 1 fails inside a step before its collectives while the driver runs the step: the
    driver's collective fails (the rank left the gloo group) and the rank's traceback is raised,
    long before the group's timeout."""
    import time

    import numpy as np

    from compilelm.graphs.step_inputs import HostBatch
    from compilelm.llm import make_engine_config
    from compilelm.runtime.executor import Executor
    from compilelm.runtime.model_runner import StepInputs
    config = make_engine_config("dummy:qwen3-0.6b", model_overrides=QWEN3[1], tensor_parallel_size=2,
                                max_model_len=128, enforce_eager=True)
    executor = Executor(config)
    try:
        executor.init_model_runner(16)
        runner = executor.model_runner
        one = np.ones(1, np.int64)  # one token, one sequence
        batch = HostBatch(one * 5, one * 0, one * 16, np.array([0, 1], np.int32), np.ones(1, np.int32),
                          np.ones((1, 1), np.int32), one * 0, 1)
        executor.broadcast.send_call("run_step", (None,), False)  # rank 1: AttributeError at once
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="(?s)rank 1 failed:.*AttributeError"):
            try:
                runner.run_step(StepInputs(batch, "none", None, 1))  # waits in a collective
            finally:
                executor._check_failures()
        assert time.perf_counter() - t0 < 60
    finally:
        executor.shutdown()


_ORPHAN_DRIVER = """
import sys, time
from compilelm.llm import make_engine_config
from compilelm.runtime.executor import Executor
if __name__ == "__main__":
    config = make_engine_config("dummy:qwen3-0.6b", model_overrides={overrides!r}, tensor_parallel_size=2,
                                max_model_len=128, enforce_eager=True)
    executor = Executor(config)
    print(executor.procs[0].pid, flush=True)
    time.sleep(600)
"""


def test_ranks_exit_when_the_driver_is_killed(tmp_path):
    """A driver killed with SIGKILL runs no cleanup: its ranks, waiting for the next command in
    the ring, notice that it is gone and exit instead of polling forever."""
    import os
    import subprocess
    import sys
    import time
    script = tmp_path / "driver.py"
    script.write_text(_ORPHAN_DRIVER.format(overrides=QWEN3[1]))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        rank_pid = int(driver.stdout.readline())
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with open(f"/proc/{rank_pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in "ZX":  # exited, not yet reaped
                        break
            except FileNotFoundError:
                break
            time.sleep(0.2)
        else:
            os.kill(rank_pid, 9)
            raise AssertionError("the rank outlived its driver by 60 s")
    finally:
        if driver.poll() is None:
            driver.kill()


_EXIT_WITHOUT_SHUTDOWN = """
from compilelm.llm import LLM
from compilelm.runtime.model_runner import ModelRunner
from compilelm.sampling_params import SamplingParams
if __name__ == "__main__":
    release = ModelRunner.release_graphs
    def spy(self):
        print("driver released its graphs", flush=True)
        release(self)
    ModelRunner.release_graphs = spy  # (this process only: the rank runs its own copy)
    llm = LLM("dummy:qwen3-0.6b", model_overrides={overrides!r}, tensor_parallel_size=2, enforce_eager=True,
              max_model_len=128, num_kv_blocks=64)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    print("exiting", flush=True)
"""


def test_a_driver_that_exits_without_shutdown_releases_its_graphs_first(tmp_path):
    """No `shutdown()` (a script that just ends): the executor's exit hook stops the ranks, and
    the driver drops its CUDA graphs before leaving the group, as shutdown does (an NCCL group
    left under graphs that captured its collectives hangs)."""
    import subprocess
    import sys
    script = tmp_path / "driver.py"
    script.write_text(_EXIT_WITHOUT_SHUTDOWN.format(overrides=QWEN3[1]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "exiting" in lines and "driver released its graphs" in lines[lines.index("exiting"):], out.stdout


def test_release_graphs_drops_every_graph_and_steps_run_eagerly():
    """What a TP rank does before leaving its NCCL group: no graph may outlive the communicator
    whose collectives it captured. On CPU there are no graphs: stand-ins with the same shape."""
    import types

    from compilelm.graphs.cudagraph.dispatch import CudaGraphDispatcher
    from compilelm.llm import LLM
    llm = LLM("dummy:qwen3-0.6b", model_overrides=QWEN3[1], max_model_len=128, num_kv_blocks=64, enforce_eager=True)
    runner = llm.engine.executor.model_runner
    full, site = types.SimpleNamespace(graphs={8: "graph"}), types.SimpleNamespace(graphs={8: "graph", 4: "graph"})
    runner.cuda_graphs, runner.piecewise_graphs = full, types.SimpleNamespace(sites={"piece_0": site})
    runner.dispatcher = CudaGraphDispatcher((8,), (8,))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.engine.executor.driver.release_graphs()
    assert full.graphs == {} and site.graphs == {}
    assert runner.cuda_graphs is None and runner.piecewise_graphs is None
    assert runner.dispatcher.dispatch(1, 1) == ("none", None)
    assert len(llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_custom_all_reduce_min_bytes_is_validated_and_configures_the_process():
    from compilelm.config import EngineConfig
    from compilelm.distributed import custom_all_reduce as car
    with pytest.raises(ValueError, match="custom_all_reduce_min_bytes"):
        EngineConfig(custom_all_reduce_min_bytes=-2)
    try:
        car.configure_custom_all_reduce(-1)
        assert car._min_bytes is None  # NCCL only: never made
        car.configure_custom_all_reduce(0)
        assert car._min_bytes == 0
    finally:
        car.configure_custom_all_reduce(None)
    assert car._min_bytes == car.MIN_BYTES


def test_leaving_the_group_drops_the_peer_buffers_first(monkeypatch):
    """destroy_distributed closes the one-shot all-reduce's buffers (collectively, unless a peer is
    gone) before it touches the process group."""
    from compilelm.distributed import custom_all_reduce, parallel_state
    calls = []
    monkeypatch.setattr(custom_all_reduce, "close_custom_all_reduce", lambda peers_present: calls.append(peers_present))
    monkeypatch.setattr(parallel_state.dist, "is_initialized", lambda: calls.append("group?") or False)
    parallel_state.destroy_distributed()
    parallel_state.destroy_distributed(abort=True)
    assert calls == [True, "group?", False, "group?"]
