"""Attribution of a profiled step (graphs/profile_attribution.py) on hand-made profiler traces in
the torch profiler's Chrome-trace format: the CUDA path (kernels found through launch
correlation ids) runs here without a GPU."""

import pytest

from compilelm.entrypoints.cli import main as cli_main
from compilelm.graphs.op_family import family
from compilelm.graphs.profile_attribution import attribute, replay, summarize


def _x(name, cat, ts, dur, tid=1, corr=None):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
            "args": {} if corr is None else {"correlation": corr}}


def _launch(ts, corr, kernel, start, dur, api="cuLaunchKernelEx", cat="cuda_driver", kcat="kernel"):
    # a launch on the host (its thread id may differ from the ops'), the kernel on the GPU
    return [_x(api, cat, ts, 3, tid=2, corr=corr), _x(kernel, kcat, start, dur, tid=7, corr=corr)]


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64"
TABLE = {"submod_2": [
    {"name": "triton_red_fused_add_mean_mul_pow_rsqrt_0", "call": 1, "nodes": ["pow_1", "mean", "rsqrt"],
     "source": ["compilelm/ops/norm.py:21 x = x * torch.rsqrt(...)"]},
    {"name": "extern_kernels.mm", "call": 2, "nodes": ["mm"], "source": ["compilelm/models/llama.py:57 gate_up"]},
    {"name": "triton_poi_fused_mul_silu_1", "call": 3, "nodes": ["mul", "silu"], "source": []},
    {"name": "triton_poi_fused_add_2", "call": 4, "nodes": ["add"], "source": []},
]}


def _cuda_trace():
    ev = [_x("compilelm.step", "user_annotation", 0, 1000),
          _x("compilelm.piece:submod_4:submod_2", "user_annotation", 10, 400),
          _x("## Call CompiledFxGraph fxyz ##", "cpu_op", 20, 380)]
    # Inductor wraps a Triton launch in a range named after the kernel (torch 2.13); a bare one counts too
    ev += [_x("triton_red_fused_add_mean_mul_pow_rsqrt_0", "cpu_op", 28, 8)]
    ev += _launch(30, 1, "triton_red_fused_add_mean_mul_pow_rsqrt_0", 100, 50)
    ev += [_x("aten::empty", "cpu_op", 37, 2)]  # launches nothing: no GPU time, not a call
    ev += [_x("aten::mm", "cpu_op", 40, 20)] + _launch(45, 2, GEMM, 150, 200, "cudaLaunchKernel", "cuda_runtime")
    ev += _launch(70, 3, "triton_poi_fused_mul_silu_1", 350, 40)
    ev += _launch(80, 4, "triton_poi_fused_add_2", 390, 20)
    # attention between the pieces: its kernel and a copy it makes
    ev += [_x("compilelm::unified_attention", "cpu_op", 500, 200), _x("aten::copy_", "cpu_op", 600, 50)]
    ev += _launch(510, 5, "paged_attention_kernel", 520, 100, "cudaLaunchKernel", "cuda_runtime")
    ev += _launch(610, 6, "Memcpy DtoD (Device -> Device)", 630, 10, "cudaMemcpyAsync", "cuda_runtime", "gpu_memcpy")
    ev += [_x("cudaDeviceSynchronize", "cuda_runtime", 900, 95)]
    ev += [_x("compilelm.step", "gpu_user_annotation", 90, 1200, tid=7)]  # the GPU's copy: not the step
    ev += [_x("ncclKernel_AllReduce", "kernel", 700, 40, tid=8, corr=77)]  # its launch is not in the trace
    ev += _launch(2000, 9, "triton_poi_fused_add_2", 2100, 5)  # after the step: not counted
    return {"traceEvents": ev}


def test_cuda_trace_attributed_to_pieces_nodes_and_families():
    result = attribute(_cuda_trace(), TABLE)
    assert result["device"] == "cuda" and result["step_us"] == 1000
    assert result["gaps_us"] == 1000 - (410 - 100) - (620 - 520) - 10 - 40  # GPU idle within the step
    s = summarize(result)
    fam = {f["family"]: f["ms"] * 1000 for f in s["families"]}
    assert fam == pytest.approx({"norm": 50, "GEMM": 200, "elementwise": 60, "attention": 110, "unattributed": 40,
                                 "launch gaps": result["gaps_us"]})
    assert s["sum_ms"] == pytest.approx(s["step_ms"])  # nothing missed, nothing counted twice
    assert s["pieces"] == [{"piece": "submod_2", "ms": 0.31, "sites": 1},
                           {"piece": "(between pieces)", "ms": 0.11, "sites": 1}]
    by_call = {(k["compiled_as"], k["call"]): k for k in s["kernels"]}
    assert all(k["name"] != "aten::empty" for k in s["kernels"])
    mm = by_call[("submod_2", 2)]
    assert mm["name"] == "aten::mm" and mm["kernels"] == [GEMM] and mm["nodes"] == ["mm"] and mm["family"] == "GEMM"
    assert by_call[("submod_2", 1)]["source"] == ["compilelm/ops/norm.py:21 x = x * torch.rsqrt(...)"]
    attention = next(k for k in s["kernels"] if k["name"] == "compilelm::unified_attention")
    assert attention["us"] == 110 and attention["family"] == "attention"
    # the chains: SiLU-mul then add after the GEMM (two launches), the norm before it (a prologue)
    chains = s["chains"]
    assert [c["calls"] for c in chains] == [[3, 4], [1]]
    assert chains[0]["launches"] == 2 and chains[0]["before"] == "GEMM (aten::mm)" and chains[0]["ms"] == 0.06
    assert chains[1]["after"] == "GEMM (aten::mm)" and chains[1]["families"] == ["norm"]


def _replay_trace(gemm_name=GEMM):
    """The same step replayed as one CUDA graph: one launch, the kernels back to back and shorter
    (no host in between), plus a kernel the eager run did not launch."""
    ev = [_x("compilelm.step", "user_annotation", 0, 400), _x("cudaGraphLaunch", "cuda_runtime", 5, 10, corr=50)]
    names = ["triton_red_fused_add_mean_mul_pow_rsqrt_0", gemm_name, "triton_poi_fused_mul_silu_1",
             "triton_poi_fused_add_2", "paged_attention_kernel", "Memcpy DtoD (Device -> Device)",
             "ncclKernel_AllReduce"]
    t = 20
    for name, dur in zip(names, (30, 150, 20, 10, 90, 5, 30)):
        ev.append(_x(name, "gpu_memcpy" if name.startswith("Memcpy") else "kernel", t, dur, tid=7, corr=50))
        t += dur + 2
    ev += [_x("triton_poi_fused_copy_9", "kernel", t, 8, tid=7, corr=50)]
    return {"traceEvents": ev}


def test_graph_replay_takes_the_eager_attribution_and_the_replay_times():
    eager = attribute(_cuda_trace(), TABLE)
    s = summarize(replay(eager, _replay_trace()))
    assert s["step_ms"] == 0.4
    fam = {f["family"]: f["ms"] * 1000 for f in s["families"]}
    # the all-reduce ran unlaunched in the eager trace and aligns with nothing there: placed by its name
    assert fam == pytest.approx({"norm": 30, "GEMM": 150, "elementwise": 30, "attention": 95, "copies": 8,
                                 "collectives": 30, "launch gaps": 400 - (30 + 150 + 20 + 10 + 90 + 5 + 30 + 8)})
    assert s["sum_ms"] == pytest.approx(s["step_ms"])
    by_call = {(k["compiled_as"], k["call"]): k for k in s["kernels"]}
    assert by_call[("submod_2", 2)]["us"] == 150 and by_call[("submod_2", 2)]["nodes"] == ["mm"]
    assert by_call[("(in the graph, not in the eager run)", None)]["name"] in ("triton_poi_fused_copy_9",
                                                                             "ncclKernel_AllReduce")
    # measured without the profiler the step is shorter: the gaps shrink, the kernels keep their times
    s3 = summarize(replay(eager, _replay_trace(), step_us=380))
    assert s3["step_ms"] == 0.38 and s3["busy_ms"] == pytest.approx(0.343) and s3["profiled_ms"] == 0.4
    assert {f["family"]: f["ms"] * 1000 for f in s3["families"]}["launch gaps"] == pytest.approx(380 - 343)
    # a GEMM the capture chose differently aligns with nothing: still counted, by name
    s2 = summarize(replay(eager, _replay_trace("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64")))
    assert {f["family"]: f["ms"] * 1000 for f in s2["families"]}["GEMM"] == pytest.approx(150)
    assert s2["sum_ms"] == pytest.approx(s2["step_ms"])


def test_overlapping_kernels_count_once():
    """With programmatic dependent launch a kernel starts while its predecessor runs (and waits
    for it): the overlap counts for the predecessor, the families add up to the step."""
    ev = [_x("compilelm.step", "user_annotation", 0, 500),
          _x("compilelm.piece:submod_4:submod_2", "user_annotation", 10, 300)]
    ev += _launch(20, 1, "triton_red_fused_add_mean_mul_pow_rsqrt_0", 100, 50)
    ev += [_x("aten::mm", "cpu_op", 40, 20)] + _launch(45, 2, GEMM, 120, 230, "cudaLaunchKernel", "cuda_runtime")
    ev += _launch(70, 3, "triton_poi_fused_mul_silu_1", 300, 60)  # starts under the GEMM
    s = summarize(attribute({"traceEvents": ev}, TABLE))
    fam = {f["family"]: f["ms"] * 1000 for f in s["families"]}
    assert fam == pytest.approx({"norm": 50, "GEMM": 200, "elementwise": 10, "launch gaps": 500 - 260})
    assert s["sum_ms"] == pytest.approx(s["step_ms"])


def test_cpu_trace_counts_host_time_outside_ops_as_gaps():
    ev = [_x("compilelm.step", "user_annotation", 0, 100),
          _x("compilelm.piece:submod_0:submod_0", "user_annotation", 5, 60),
          _x("## Call CompiledFxGraph fx ##", "cpu_op", 6, 58),
          _x("graph_0_cpp_fused_add_mean_mul_pow_rsqrt_0", "cpu_op", 10, 10),
          _x("aten::mm", "cpu_op", 25, 30), _x("aten::resolve_conj", "cpu_op", 26, 1),
          _x("compilelm::unified_attention", "cpu_op", 70, 20), _x("aten::bmm", "cpu_op", 72, 10)]
    table = {"submod_0": [{"name": "cpp_fused_add_mean_mul_pow_rsqrt_0", "call": 1, "nodes": ["mean"], "source": []},
                          {"name": "extern_kernels.mm", "call": 2, "nodes": ["mm"], "source": []}]}
    s = summarize(attribute({"traceEvents": ev}, table))
    fam = {f["family"]: f["ms"] * 1000 for f in s["families"]}
    assert fam == pytest.approx({"norm": 10, "GEMM": 30, "attention": 20, "launch gaps": 40})
    assert {(k["compiled_as"], k["call"]) for k in s["kernels"]} >= {("submod_0", 1), ("submod_0", 2)}


@pytest.mark.parametrize("names, sources, expected", [
    (["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"], [], "norm"),
    (["cpp_fused_add_index_mul_slice_sub_1"], ["compilelm/ops/rope.py:29 apply_rope"], "rope"),
    (["aten::addmm"], [], "GEMM"), (["compilelm::rms_norm_linear"], [], "GEMM"),
    (["compilelm::unified_attention_qknorm_rope"], [], "attention"), (["compilelm::rope_cache"], [], "rope"),
    (["Memcpy HtoD (Pageable -> Device)"], [], "copies"), (["triton_poi_fused_mul_silu_0"], [], "elementwise"),
    (["compilelm::all_reduce"], [], "collectives"), (["compilelm::scaled_fp8_quant"], [], "quant"),
])
def test_op_families(names, sources, expected):
    assert family(names, sources) == expected


@pytest.mark.parametrize("args, message", [
    (["--profile"], "give --dump DIR too"),
    (["--profile", "--dump", "/tmp/x", "--profile-decode", "8by5"], "--profile-decode wants SEQSxTOKENS"),
])
def test_profile_flags_are_checked(args, message, capsys):
    assert cli_main(["compile", "dummy:smollm2-135m", *args]) == 2
    assert message in capsys.readouterr().err
