"""Structured outputs in the runtime: constraints -> llguidance grammars (and the errors of bad
ones), the bitmask applied on the logits, and the engine: every constrained output follows its
grammar and ends when the value is complete, async scheduling gives the synchronous engine's
tokens, and it keeps running step N+1's forward ahead of step N's processing (a constrained row
waits for its own token, nothing else waits)."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from compilelm import LLM, SamplingParams
from compilelm.ops.token_bitmask import mask_logits_rows_
from compilelm.runtime.structured_output import GrammarError, fill_token_bitmask
from compilelm.sampling_params import StructuredOutputsParams as S

TINY = dict(model_overrides={"num_hidden_layers": 2}, max_model_len=256, num_kv_blocks=64,
            enforce_eager=True, max_num_batched_tokens=64)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "size"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def engines():
    """(sync, async) engines over the same random weights, the default model's tokenizer."""
    return tuple(LLM("dummy:smollm2-135m", async_scheduling=a, **TINY).engine for a in (False, True))


def _check_schema_value(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "tags", "size"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert all(t in ("a", "b") for t in value["tags"]) and len(value["tags"]) <= 3
    assert isinstance(value["size"], int) and 0 <= value["size"] <= 99


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="exactly one.*json, regex"):
        S(json={}, regex="a")
    with pytest.raises(ValueError, match="choice must not be empty"):
        S(choice=[])
    with pytest.raises(ValueError, match="list of strings"):
        S(choice="ab")
    assert S(choice=["a", "b"]).choice == ("a", "b") and S(json_object=True).kind == "json_object"


@pytest.mark.parametrize("params, message", [
    (S(json="{not json"), "not valid JSON"),
    (S(json={"type": "frobnicate"}), "frobnicate"),
    (S(json="[1]"), "must be an object"),
    (S(regex="(abc"), "unclosed group"),
    (S(grammar="start: undefined_rule"), "undefined_rule"),
    (S(structural_tag='{"structures": []}'), "non-empty"),
    (S(structural_tag='{"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<g"]}'), "none of the triggers"),
])
def test_bad_constraints_are_grammar_errors(engines, params, message):
    with pytest.raises(GrammarError, match=message):
        engines[0].structured_output.compile(params)
    with pytest.raises(ValueError, match=message):  # and the engine refuses the request, adding nothing
        engines[0].add_request("bad", [1, 2], SamplingParams(structured_outputs=params))
    assert not engines[0].has_unfinished_requests()


def test_compiles_are_cached(engines):
    backend = engines[0].structured_output
    assert backend.compile(S(json=SCHEMA)) is backend.compile(S(json=dict(SCHEMA)))
    assert backend.matcher(S(json=SCHEMA)) is not backend.matcher(S(json=SCHEMA))  # a copy per request


def test_bitmask_applies_each_rows_mask_and_leaves_others():
    from compilelm.models.loader import resolve_model
    from compilelm.models.tokenizer import load_tokenizer
    from compilelm.runtime.structured_output import GuidanceBackend

    tok = load_tokenizer(resolve_model(None))
    backend = GuidanceBackend(tok, 49152, [tok.eos_token_id])
    a, b = backend.matcher(S(regex="[0-9]+")), backend.matcher(S(choice=["hello world"]))
    assert a.consume_tokens(tok.encode("12", add_special_tokens=False))
    bitmask = fill_token_bitmask(backend.mask_executor(), [a, b], backend.mask_vocab, pin=False)
    logits = torch.randn(3, 49152)
    before = logits.clone()
    packed = torch.cat([bitmask.flatten(), torch.tensor([2, 0], dtype=torch.int32)])  # masks, then their rows
    mask_logits_rows_(logits, packed, 2, bitmask.shape[1])
    assert torch.equal(logits[1], before[1])  # unconstrained row untouched
    for row, matcher in ((2, a), (0, b)):
        allowed = torch.isfinite(logits[row])
        ids = torch.nonzero(allowed).flatten().tolist()
        assert ids and all(matcher.validate_tokens([t]) == 1 for t in ids[:200])
        assert torch.equal(logits[row][allowed], before[row][allowed])
        refused = torch.nonzero(~allowed).flatten()[:: 997].tolist()
        assert all(matcher.validate_tokens([t]) == 0 for t in refused)
    assert allowed[tok.eos_token_id].item() is False  # "hello world" not yet written

    # the mask thread packs the same masks and their rows, into its reused buffer (grown for more rows)
    filler = backend.mask_filler(pin=False)
    assert torch.equal(filler.start([a, b], [2, 0]).result(), packed)
    many = [backend.matcher(S(regex="[0-9]+")) for _ in range(9)] + [b]
    got = filler.start(many, list(range(10))).result()
    words = bitmask.shape[1]
    assert got.shape == (10 * words + 10,) and torch.equal(got[9 * words:10 * words], bitmask[1])
    assert got[10 * words:].tolist() == list(range(10))
    assert torch.equal(filler.start([b, a], [5, 7]).result()[:2 * words], bitmask.flip(0).flatten())
    filler.threaded = False  # on the calling thread: the same words, the Future already done
    inline = filler.start([a, b], [2, 0])
    assert inline.done() and torch.equal(inline.result(), packed)


def _requests():
    reqs = [("json0", "A person:", SamplingParams(temperature=0, max_tokens=80, structured_outputs=S(json=SCHEMA))),
            ("regex", "Phone:", SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                                               structured_outputs=S(regex=r"\(\d{3}\) \d{3}-\d{4}"))),
            ("choice", "Pick:", SamplingParams(temperature=1.0, seed=5, max_tokens=10,
                                               structured_outputs=S(choice=["alpha", "beta gamma"])))]
    reqs += [(f"json{i}", "Data:", SamplingParams(temperature=1.0, seed=i, max_tokens=120,
                                                  structured_outputs=S(json=SCHEMA))) for i in range(1, 4)]
    reqs += [(f"plain{i}", [10 + i, 11, 12], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
             for i in range(4)]
    return reqs


def _run(engine, requests):
    """Outputs by id, and the run_step count at each update_from_output."""
    runs, updates = [], []
    run_step, update = engine.model_runner.run_step, engine.scheduler.update_from_output
    engine.model_runner.run_step = lambda step: (runs.append(1), run_step(step))[1]
    engine.scheduler.update_from_output = lambda *a: (updates.append(len(runs)), update(*a))[1]
    try:
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        last = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                last[out.request_id] = out
    finally:
        del engine.model_runner.run_step, engine.scheduler.update_from_output
    assert engine.kv_cache_manager.usage == 0.0
    outs = {k: (v.outputs[0].token_ids, v.outputs[0].text, v.outputs[0].finish_reason) for k, v in last.items()}
    return outs, updates


def test_a_wider_model_than_its_tokenizer_keeps_the_tokenizers_eos():
    """A model config whose end-of-sequence ids lie past a tokenizer it shares (a random-weight
    Qwen3 shape run with SmolLM2's tokenizer): masks are built with the tokenizer's own eos, over
    the model's wider vocabulary; with no eos of the tokenizer, a clear GrammarError."""
    from compilelm.models.loader import resolve_model
    from compilelm.models.tokenizer import load_tokenizer
    from compilelm.runtime.structured_output import GuidanceBackend

    tok = load_tokenizer(resolve_model(None))
    backend = GuidanceBackend(tok, 151936, [151645, tok.eos_token_id])
    m = backend.matcher(S(choice=["yes"]))
    assert m.consume_tokens(tok.encode("yes", add_special_tokens=False))
    mask = fill_token_bitmask(backend.mask_executor(), [m], backend.mask_vocab, pin=False)
    allowed = [t for t in range(backend.mask_vocab) if mask[0, t // 32] >> (t % 32) & 1]
    assert allowed == [tok.eos_token_id] and backend.mask_vocab >= 151936
    with pytest.raises(GrammarError, match="end-of-sequence token of the tokenizer"):
        GuidanceBackend(tok, 151936, [151645]).matcher(S(regex="a"))


def test_constrained_outputs_follow_their_grammar_sync_and_async(engines):
    interval = sys.getswitchinterval()
    (sync, _), (asyn, updates) = (_run(e, _requests()) for e in engines)
    assert sync == asyn
    assert sys.getswitchinterval() == interval  # the mask thread's handoff interval is undone
    for i in range(4):
        tokens, text, reason = sync[f"json{i}"]
        assert reason == "stop", text  # ended by the grammar (the value is complete), not by length
        _check_schema_value(text)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", sync["regex"][1]) and sync["regex"][2] == "stop"
    assert sync["choice"][1] in ("alpha", "beta gamma") and sync["choice"][2] == "stop"
    assert all(len(sync[f"plain{i}"][0]) == 12 for i in range(4))
    # async: every step's tokens were processed after the next step's forward was launched
    # (the last updates come after the last forward)
    assert all(runs > k + 1 for k, runs in enumerate(updates[:-2])), updates


def test_structural_tag_constrains_only_inside_its_tags(engines):
    tag = json.dumps({"structures": [{"begin": "<function=get_weather>", "end": "</function>", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}], "triggers": ["<function="]})
    backend, tok = engines[0].structured_output, engines[0].tokenizer

    def accepts(text: str) -> bool:
        matcher = backend.matcher(S(structural_tag=tag))
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids)

    assert accepts('Sure. <function=get_weather>{"city": "Paris"}</function> Anything else?')
    assert accepts("No tool needed here.")
    assert not accepts('<function=get_weather>{"town": "Paris"}</function>')
    assert not accepts("<function=get_time>{}</function>")


def test_disable_any_whitespace_gives_compact_json(engines):
    schema = S(json=SCHEMA, disable_any_whitespace=True)
    outs, _ = _run(engines[1], [(f"c{i}", "JSON:", SamplingParams(temperature=1.0, seed=i, max_tokens=80,
                                                                   structured_outputs=schema)) for i in range(3)])
    for _, text, reason in outs.values():
        assert reason == "stop" and text == json.dumps(json.loads(text), separators=(",", ":"),
                                                       ensure_ascii=False), text


# -- the reasoning gate: with a reasoning parser, the grammar holds after </think> ----------------

THINK, END_THINK = 14, 15  # two of SmolLM2's special tokens, renamed <think> / </think> below


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer with <jupyter_output> / <jupyter_script> renamed <think> / </think>:
    single-token tags, as Qwen3's and DeepSeek-R1's are."""
    import gzip
    import os
    import shutil

    src = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "smollm2_tokenizer")
    folder = tmp_path_factory.mktemp("think_tokenizer")
    shutil.copy(os.path.join(src, "tokenizer_config.json"), folder)
    with gzip.open(os.path.join(src, "tokenizer.json.gz"), "rt") as f:
        data = json.load(f)
    renames = {"<jupyter_output>": "<think>", "<jupyter_script>": "</think>"}
    for token in data["added_tokens"]:
        token["content"] = renames.get(token["content"], token["content"])
    vocab = data["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return str(folder)


def _forced(script: dict[int, int]):
    """A logits processor that forces token script[i] at output position i (else leaves the row)."""
    def force(output_ids, row):
        token = script.get(len(output_ids))
        if token is not None:
            row = torch.full_like(row, -1e9)
            row[token] = 0.0
        return row
    return force


def test_reasoning_gate_states():
    from compilelm.runtime.structured_output.reasoning import ReasoningGate

    qwen3, r1 = ReasoningGate(THINK, END_THINK, True), ReasoningGate(THINK, END_THINK, False)
    assert qwen3.first_state([5, 6]) == "open" and r1.first_state([5, 6]) == "reasoning"
    assert qwen3.first_state([5, THINK, 7]) == r1.first_state([5, THINK]) == "reasoning"  # opened by the prompt
    assert qwen3.first_state([THINK, 9, END_THINK, 7]) == r1.first_state([THINK, END_THINK]) == "grammar"
    assert qwen3.first_state([THINK, END_THINK, 3, THINK]) == "reasoning"  # the last tag counts


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_grammar_holds_after_the_reasoning(think_tokenizer, parser):
    llm = LLM("dummy:smollm2-135m", tokenizer=think_tokenizer, reasoning_parser=parser, **TINY)
    gate = llm.engine.reasoning_gate
    assert (gate.start_id, gate.end_id) == (THINK, END_THINK)
    hello = llm.tokenizer.encode(" hello world", add_special_tokens=False)
    # qwen3's output opens the block itself (the mask lets <think> through); deepseek_r1's prompt did
    script = ({0: THINK, 1: hello[0], 2: hello[1], 3: END_THINK} if parser == "qwen3"
              else {0: hello[0], 1: hello[1], 2: END_THINK})
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=S(json=SCHEMA),
                            logits_processors=[_forced(script)], skip_special_tokens=False)
    out = llm.generate("A person:", params, use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    end = ids.index(END_THINK)
    assert ids[:end + 1] == [script[i] for i in range(end + 1)]  # the reasoning was not masked
    assert out.finish_reason == "stop"  # the grammar ended it
    _check_schema_value(llm.tokenizer.decode(ids[end + 1:]))

    # a prompt whose think block is closed (a template with thinking off): the grammar from the start
    closed = [*llm.tokenizer.encode("A person:", add_special_tokens=False), THINK, END_THINK]
    plain = SamplingParams(temperature=0, max_tokens=100, structured_outputs=S(json=SCHEMA))
    out = llm.generate(closed, plain, use_tqdm=False)[0].outputs[0]
    _check_schema_value(out.text)


def test_reasoning_gate_needs_single_token_tags():
    from compilelm.models.loader import resolve_model
    from compilelm.models.tokenizer import load_tokenizer
    from compilelm.runtime.structured_output.reasoning import reasoning_gate

    assert reasoning_gate("qwen3", load_tokenizer(resolve_model(None))) is None  # SmolLM2: <think> is 3 tokens
    assert reasoning_gate(None, None) is None


def test_reasoning_parser_names_agree():
    from compilelm.config import REASONING_PARSERS, EngineConfig
    from compilelm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS as SERVER_PARSERS
    from compilelm.runtime.structured_output.reasoning import REASONING_TAGS

    assert set(REASONING_PARSERS) == set(REASONING_TAGS) == set(SERVER_PARSERS)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        EngineConfig(reasoning_parser="granite")
