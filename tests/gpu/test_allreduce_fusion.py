"""The one-shot all-reduce (+ add + RMSNorm) kernel on 2 GPUs (csrc/cuda/allreduce_kernels.cu,
compilelm/distributed/custom_all_reduce.py): against NCCL's all-reduce + the reference add+norm,
bit-identical across ranks, NCCL fallback past the buffer or for shapes it does not take,
CUDA-graph capture + replay with new values, and a TP=2 engine with the fusion on == off == TP=1.

Two ranks: a one-shot sum of two values is one fp32 addition rounded once, as NCCL's is, so the
sum and residual_out must equal the NCCL path exactly; the normed rows may differ by one step
where the order of the sum of squares moves a rounding (as test_fused_kernels.py allows).

Run as a script (`python -m tests.gpu.test_allreduce_fusion OUT.json`) for the timing table.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys

import pytest
import torch
import torch.multiprocessing as mp

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (shared hosts)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]

WORLD = 2
EPS = 1e-6
MAX_BYTES = 1 << 20  # the tests' buffer: 1 MiB, so the fallback is reached with small tensors
STEP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args):
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, port, failures, args)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    errors = [failures.get() for _ in range(failures.qsize())] if not failures.empty() else []
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not errors and all(p.exitcode == 0 for p in procs), errors or [p.exitcode for p in procs]


def _rank_main(fn, rank, port, failures, args):
    import compilelm.ops  # noqa: F401  (loads the kernels)
    import compilelm.ops.collectives  # noqa: F401  (registers the ops' CUDA impls)
    from compilelm.distributed.parallel_state import destroy_distributed, init_distributed
    try:
        device = torch.device("cuda", rank)
        init_distributed(rank, WORLD, f"tcp://127.0.0.1:{port}", device)
        fn(rank, device, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback
        failures.put(f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
        raise
    finally:
        destroy_distributed()


def _inputs(rank, num_tokens, hidden, dtype, device, seed=0):
    """x differs per rank; residual and weight are the same on every rank (as in the model)."""
    g = torch.Generator().manual_seed(seed)
    residual, weight = torch.randn(num_tokens, hidden, generator=g), torch.rand(hidden, generator=g) + 0.5
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + 100 + rank))
    return tuple(t.to(device, dtype) for t in (x, residual, weight))


def _nccl_reference(x, residual, weight):
    import torch.distributed as dist

    from compilelm.ops.collectives import fused_add_rms_norm_ref
    total = x.clone()
    dist.all_reduce(total)
    return total, *fused_add_rms_norm_ref(total, residual, weight, EPS)


def _same_on_all_ranks(*tensors):
    import torch.distributed as dist
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(WORLD)]
        dist.all_gather(parts, t.contiguous())
        assert all(torch.equal(parts[0], p) for p in parts[1:]), "ranks disagree"


def _check(x, residual, weight):
    ops = torch.ops.compilelm
    total, want, want_residual = _nccl_reference(x, residual, weight)
    normed, res_out = ops.fused_allreduce_add_rms_norm(x, residual, weight, EPS)
    summed = ops.all_reduce(x)
    assert torch.equal(summed, total)
    assert torch.equal(res_out, want_residual)
    torch.testing.assert_close(normed, want, rtol=max(STEP[x.dtype], 1e-5), atol=1e-6)
    assert (normed != want).float().mean().item() <= (1e-3 if x.dtype != torch.float32 else 0.5)
    _same_on_all_ranks(normed, res_out, summed)


CASES = [(1, 4096), (7, 4096), (64, 4096), (255, 1000), (129, 512)]  # > 128 rows: blocks take several


def _kernel_vs_nccl(rank, device):
    from compilelm.distributed.custom_all_reduce import get_custom_all_reduce, init_custom_all_reduce
    car = init_custom_all_reduce(device, MAX_BYTES, min_bytes=0)  # the kernel at every size it takes
    assert car is not None and get_custom_all_reduce(torch.empty(1, device=device)) is car
    for dtype in (torch.float32, torch.bfloat16):
        for num_tokens, hidden in CASES:
            x, residual, weight = _inputs(rank, num_tokens, hidden, dtype, device)
            assert car.fits(x, residual, weight), (num_tokens, hidden, dtype)
            _check(x, residual, weight)
        # the NCCL fallback: larger than the buffer, a hidden size that is not whole 16-byte vectors
        for num_tokens, hidden in ((300, 4096), (3, 1001)):
            x, residual, weight = _inputs(rank, num_tokens, hidden, dtype, device)
            assert not car.fits(x, residual, weight), (num_tokens, hidden, dtype)
            _check(x, residual, weight)
    # back to back with no host sync: every call reuses the flags and the buffer
    outs, wants = [], []
    for i, (num_tokens, hidden) in enumerate(CASES * 4):
        x, residual, weight = _inputs(rank, num_tokens, hidden, torch.bfloat16, device, seed=i)
        outs.append(torch.ops.compilelm.fused_allreduce_add_rms_norm(x, residual, weight, EPS)[1])
        wants.append((x, residual, weight))
    for out, inputs in zip(outs, wants):
        assert torch.equal(out, _nccl_reference(*inputs)[2])


def test_kernel_matches_nccl_and_is_identical_across_ranks():
    _spawn(_kernel_vs_nccl)


def _graph_replay(rank, device):
    from compilelm.distributed.custom_all_reduce import init_custom_all_reduce
    init_custom_all_reduce(device, MAX_BYTES, min_bytes=0)
    ops = torch.ops.compilelm
    x, residual, weight = _inputs(rank, 5, 4096, torch.bfloat16, device)
    ops.fused_allreduce_add_rms_norm(x, residual, weight, EPS)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, res_out = ops.fused_allreduce_add_rms_norm(x, residual, weight, EPS)
        summed = ops.all_reduce(res_out)  # a second one-shot in the same graph
    for step in range(3):
        new = _inputs(rank, 5, 4096, torch.bfloat16, device, seed=step + 1)
        for buf, val in zip((x, residual, weight), new):
            buf.copy_(val)
        graph.replay()
        _, want, want_residual = _nccl_reference(x, residual, weight)
        torch.testing.assert_close(normed, want, rtol=STEP[torch.bfloat16], atol=1e-6)
        assert torch.equal(res_out, want_residual)
        want_sum = res_out.clone()
        torch.distributed.all_reduce(want_sum)
        assert torch.equal(summed, want_sum)
        _same_on_all_ranks(normed, res_out, summed)


def test_cuda_graph_capture_and_replay_with_new_values():
    _spawn(_graph_replay)


# -- the engine: TP=2 with the fusion on == off == TP=1 ----------------------------------------

PROMPTS = [[11, 2, 30, 4, 500, 6, 7], [9, 99, 999], list(range(40, 80))]
QWEN3 = ("dummy:qwen3-0.6b", {"num_hidden_layers": 2, "vocab_size": 4096})


def _generate(tp: int, **kw):
    from compilelm.llm import LLM
    from compilelm.sampling_params import SamplingParams
    llm = LLM(QWEN3[0], model_overrides=QWEN3[1], max_model_len=128, num_kv_blocks=64, device="cuda",
              dtype="float32", tensor_parallel_size=tp, **kw)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        if kw.get("custom_all_reduce_min_bytes") == 0:  # rank 0 ran the one-shot kernel at every size
            from compilelm.distributed import custom_all_reduce
            assert custom_all_reduce._instance is not None and custom_all_reduce._instance.min_bytes == 0
        return tokens
    finally:
        llm.engine.shutdown()


def test_tp2_fused_equals_unfused_equals_tp1(tmp_path):
    """Compiled, full CUDA graphs; the fused engine takes the one-shot kernel at every size (decode
    batches replay it), the unfused one NCCL, both in this process one after the other (the second
    engine maps fresh peer buffers: its rank 1 is a new process). fp32: in bf16 the
    TP=2 sum is rounded to bf16 once more than TP=1's single matmul (the all-reduce's output
    dtype), so TP=2 and TP=1 are different computations and random dummy weights may pick other
    greedy tokens; in fp32 those roundings are ~1e-7 and the tokens must agree."""
    tokens = {}
    for fuse in (True, False):
        cc = {"passes": {"fuse_allreduce_rms": fuse}, "cache_dir": str(tmp_path / f"cache_{fuse}"),
              "cudagraph_mode": "full", "cudagraph_capture_sizes": [1, 2, 4]}
        tokens[fuse] = _generate(2, compilation_config=cc, custom_all_reduce_min_bytes=0 if fuse else -1)
    tokens["tp1"] = _generate(1, enforce_eager=True)
    assert tokens[True] == tokens[False] == tokens["tp1"], tokens


# -- timing table (script) ---------------------------------------------------------------------

TIMING_TOKENS = (1, 8, 64, 256)
CALLS_PER_GRAPH = 10


def _graph_us(fn):
    """Median over 50 replays of a CUDA graph of CALLS_PER_GRAPH calls, per call (GPU time,
    without Python's launch overhead, as decode steps run)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    return statistics.median(times)


def _timing(rank, device, out_path):
    import torch.distributed as dist

    from compilelm.distributed.custom_all_reduce import init_custom_all_reduce
    init_custom_all_reduce(device, min_bytes=0)  # the default buffer (8 MiB), the kernel at every size
    ops = torch.ops.compilelm
    results = []
    for num_tokens in TIMING_TOKENS:
        x, residual, weight = _inputs(rank, num_tokens, 4096, torch.bfloat16, device)
        buf = x.clone()
        dist.all_reduce(buf)  # NCCL's communicator exists before any capture

        def nccl_then_norm():
            total = x.clone()
            dist.all_reduce(total)
            ops.fused_add_rms_norm(total, residual, weight, EPS)

        row = {"num_tokens": num_tokens, "hidden": 4096, "dtype": "bfloat16",
               "one_shot_fused_us": _graph_us(lambda: ops.fused_allreduce_add_rms_norm(x, residual, weight, EPS)),
               "nccl_all_reduce_plus_fused_add_rms_norm_us": _graph_us(nccl_then_norm),
               "one_shot_all_reduce_us": _graph_us(lambda: ops.all_reduce(x)),
               "nccl_all_reduce_us": _graph_us(lambda: dist.all_reduce(buf))}
        row = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
        row["speedup"] = round(row["nccl_all_reduce_plus_fused_add_rms_norm_us"] / row["one_shot_fused_us"], 2)
        results.append(row)
        if rank == 0:
            print(f"{num_tokens:4d} x 4096 bf16  one-shot fused {row['one_shot_fused_us']:7.2f} us  "
                  f"NCCL + fused_add_rms_norm {row['nccl_all_reduce_plus_fused_add_rms_norm_us']:7.2f} us  "
                  f"x{row['speedup']:.2f}  | one-shot AR {row['one_shot_all_reduce_us']:7.2f} us  "
                  f"NCCL AR {row['nccl_all_reduce_us']:7.2f} us", flush=True)
    if rank == 0:
        data = {"gpu": f"{WORLD} x {torch.cuda.get_device_name()}", "torch": torch.__version__,
                "commit": os.environ.get("COMMIT", ""), "tensor_parallel_size": WORLD,
                "method": f"CUDA graph of {CALLS_PER_GRAPH} back-to-back calls per rank, median of 50 replays "
                          "(CUDA events) / calls, rank 0's numbers; NCCL path = clone + dist.all_reduce + "
                          "compilelm::fused_add_rms_norm (the fused op's fallback); NCCL_NVLS_ENABLE=0",
                "results": results}
        with open(out_path, "w") as f:
            json.dump(data, f, indent=2)


if __name__ == "__main__":
    _spawn(_timing, sys.argv[1])
