"""`compile --profile`: run the compiled model for a decode step and a prefill step under the
torch profiler and say where the time went (profile_attribution.py), per step:

    DIR/profile/<step>.trace.json   the profiler's trace (open it in Perfetto or chrome://tracing)
    DIR/profile/profile.json        every step's tables (the report's Profile section)

A step is what the engine runs for that batch: the compiled forward, with each layer's attention
between the pieces reading this step's paged KV cache, then the LM head on the rows sampled.
Inputs are random token ids; the KV cache (zeros, with room for the context) is made here.

On the CPU the step runs op by op. On a GPU it is measured as served: captured as one CUDA graph
and replayed (`measured_ms`, median of `repeat` replays without the profiler, next to `eager_ms`
for the op-by-op run). The profiler cannot see pieces inside a replay, so the step is profiled
twice: op by op (`<step>.eager.trace.json`, which names each kernel's piece, FX nodes and family)
and replayed (`<step>.trace.json`, whose kernel times the tables report; profile_attribution.replay
aligns the two). A step that cannot be captured is reported op by op, with the reason in
`cuda_graph`.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from compilelm.distributed.parallel_state import get_tp_size, kv_heads_per_rank
from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from compilelm.graphs.profile_attribution import LM_HEAD, PIECE, STEP, attribute, replay, summarize

# The profile needs Inductor's CPU kernels to show in the profiler (CUDA kernels always do).
PROFILE_PATCHES = {"cpp.enable_kernel_profile": True}


@dataclass(frozen=True)
class StepSpec:
    name: str  # "decode" or "prefill"
    seqs: int
    new_tokens: int  # per sequence: 1 for a decode step
    context: int  # tokens per sequence once this step has run

    @classmethod
    def parse(cls, name: str, text: str) -> StepSpec:
        """"8x512": 8 sequences at context 512 (decode: one new token each; prefill: all 512 new)."""
        try:
            seqs, tokens = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"--profile-{name} wants SEQSxTOKENS, e.g. 8x512, got {text!r}") from None
        if seqs < 1 or tokens < 1:
            raise ValueError(f"--profile-{name} wants positive sizes, got {text!r}")
        return cls(name, seqs, 1 if name == "decode" else tokens, tokens)


def profile_model(cm, specs: list[StepSpec], block_size: int, out_dir: str, warmup: int = 2,
                  repeat: int | None = None) -> dict:
    """`cm`: a CompiledModel of a compilelm model (attention_layer_names, compute_logits).
    `repeat`: timed runs without the profiler (default 20 on a GPU, 5 on the CPU)."""
    os.makedirs(out_dir, exist_ok=True)
    repeat = repeat or (20 if _device(cm.model).type == "cuda" else 5)
    kernels = cm.dumper.kernels if cm.dumper else {}
    steps = []
    for spec in specs:
        tokens = spec.seqs * spec.new_tokens  # a static compile size of that many tokens runs its own code
        tables = {name.rsplit("-", 1)[0]: kernels.get(name.replace("-dyn", f"-{tokens}"), k)
                  for name, k in kernels.items() if name.endswith("-dyn")}
        run = _make_step(cm, spec, block_size)
        cuda = _device(cm.model).type == "cuda"
        eager_ms = _median_ms(run, warmup, repeat)
        trace_file = os.path.join(out_dir, f"{spec.name}.eager.trace.json" if cuda else f"{spec.name}.trace.json")
        result = attribute(_profiled(cm, run, trace_file), tables)
        measured_ms, graph = eager_ms, _as_cuda_graph(run) if cuda else None
        if callable(graph):  # the step as served: one graph replay; the eager run names the kernels
            measured_ms = _median_ms(graph, warmup, repeat)
            trace_file = os.path.join(out_dir, f"{spec.name}.trace.json")
            result = replay(result, _profiled(cm, graph, trace_file), step_us=measured_ms * 1000)
        steps.append({**asdict(spec), **summarize(result), "measured_ms": measured_ms, "eager_ms": eager_ms,
                      "cuda_graph": graph if isinstance(graph, str) else graph is not None, "repeat": repeat,
                      "trace": os.path.relpath(trace_file, os.path.dirname(out_dir))})
    data = {"steps": steps, "device": str(_device(cm.model))}
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(data, f, indent=1)
    return data


def _median_ms(run, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _profiled(cm, run, trace_file: str) -> dict:
    """The chrome trace of one run of `run` under the torch profiler, pieces annotated."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if _device(cm.model).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with _annotated_pieces(cm), torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function(STEP):
            run()
    prof.export_chrome_trace(trace_file)
    with open(trace_file) as f:
        return json.load(f)


def _as_cuda_graph(run):
    """`run` captured as one CUDA graph: a function replaying it (synchronized), or why not (str)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run(sync_after=False)
    except RuntimeError as e:  # e.g. a host sync inside the step
        return f"not captured: {str(e).splitlines()[0]}"

    def replay_step():
        graph.replay()
        torch.cuda.synchronize()

    return replay_step


def _device(model) -> torch.device:
    return next(iter(model.parameters())).device


def _make_step(cm, spec: StepSpec, block_size: int):
    """A function running one step of `spec` (forward + LM head), synchronized."""
    model, device = cm.model, _device(cm.model)
    config = model.config
    blocks = -(-spec.context // block_size)
    tables = torch.arange(1, spec.seqs * blocks + 1, dtype=torch.int32).view(spec.seqs, blocks)  # block 0: null
    pos = torch.arange(spec.context - spec.new_tokens, spec.context).repeat(spec.seqs)
    rows = torch.arange(spec.seqs).repeat_interleave(spec.new_tokens)
    slots = tables[rows, pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(
        slot_mapping=slots.to(device), seq_lens=torch.full((spec.seqs,), spec.context, dtype=torch.int32).to(device),
        cu_seqlens_q=torch.arange(0, (spec.seqs + 1) * spec.new_tokens, spec.new_tokens, dtype=torch.int32).to(device),
        block_tables=tables.to(device), max_query_len=spec.new_tokens, max_seq_len=spec.context)
    shape = (spec.seqs * blocks + 1, block_size, kv_heads_per_rank(config.num_key_value_heads, get_tp_size()),
             config.head_dim)
    dtype = next(iter(model.parameters())).dtype
    kv = {name: (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
          for name in model.attention_layer_names()}
    ids = torch.randint(0, config.vocab_size, (len(pos),), generator=torch.Generator().manual_seed(0)).to(device)
    positions, last = pos.to(device), (torch.arange(1, spec.seqs + 1) * spec.new_tokens - 1).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    @torch.inference_mode()
    def run(sync_after: bool = True):
        with set_forward_context(ForwardContext(meta, kv)):
            hidden = cm.forward(ids, positions)
        with torch.profiler.record_function(LM_HEAD):
            model.compute_logits(hidden[last])
        if sync_after:
            sync()

    return run


@contextlib.contextmanager
def _annotated_pieces(cm):
    """Each piece call inside a profiler range named after its call site and compiled piece."""
    scope = cm.graph_fn.__globals__
    saved = {site: scope[f"piece_{site}"] for site in cm.runners}

    def annotate(label, fn):
        def piece(*args):
            with torch.profiler.record_function(label):
                return fn(*args)
        return piece

    for site, fn in saved.items():
        scope[f"piece_{site}"] = annotate(f"{PIECE}{site}:{cm.runners[site].name}", fn)
    try:
        yield
    finally:
        scope.update({f"piece_{site}": fn for site, fn in saved.items()})
