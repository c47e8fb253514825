"""The JSON-object automaton behind `response_format: json_object`, checked against `json.loads`:
every prefix it accepts can still become valid JSON, everything it completes parses to a dict,
and random walks over the real tokenizer's masks only ever end in valid JSON objects."""

from __future__ import annotations

import json
import random

import pytest
import torch

from compilelm.entrypoints.openai.json_mode import _INITIAL, JsonObjectLogitsProcessor, JsonVocab, advance_text

VALID = ['{}', '{"a": 1}', '{"a": [1, 2.5, -3e+2, 0.1E-4, true, false, null]}',
         '{"k": {"n": {"m": []}}, "s": "q\\"uo\\\\te\\u00e9\\n"}', '{ "x" : "  " , "y":{} }',
         '{"neg": -0, "f": 0.0, "big": 12345678901234567890}', '{"a":[[],[[]],{}]}']
INVALID = ['{"a": 1d}', '{"a": 5x}', '[]', '"s"', '1', '{a: 1}', "{'a': 1}", '{"a": 01}', '{"a": 1,}', '{"a": tru}',
           '{"a": .5}', '{"a": 1.}', '{"a" 1}', '{"a": "\n"}', '{"a": "\\x"}', '{"a": [1}',
           '{"a": 1}}', '{"a": -}', '{} {}', '{"a": 1e}', '{"a": "\\u12G4"}']


def _complete(text: str) -> bool:
    state = advance_text(_INITIAL, text)
    return state is not None and state[0] == ("END",)


@pytest.mark.parametrize("text", VALID)
def test_valid_objects_are_accepted_and_complete(text):
    assert isinstance(json.loads(text), dict)
    assert _complete(text)
    for i in range(len(text)):  # every prefix is alive and incomplete
        state = advance_text(_INITIAL, text[:i])
        assert state is not None and state[0] != ("END",), text[:i]


@pytest.mark.parametrize("text", INVALID)
def test_invalid_texts_never_complete(text):
    with pytest.raises(ValueError):
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError("not an object")
    assert not _complete(text)


class _CharTokenizer:
    """Every printable ASCII character is a token, plus a few multi-character ones; id 0 is EOS."""

    def __init__(self):
        self.vocab = ["<eos>"] + [chr(c) for c in range(32, 127)] + ["\n", '":', '"}', "}}", "]}",
                                                                        ' "', "true", "nu", "1.5"]
        self.all_special_ids = [0]
        self.added_tokens_decoder = {0: "<eos>"}

    def __len__(self):
        return len(self.vocab)

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.index(text)]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids if i != 0)

    def batch_decode(self, batch):
        return [self.decode(ids) for ids in batch]


def _random_walk(vocab: JsonVocab, decode, rng: random.Random, max_steps: int, eos: int):
    proc = JsonObjectLogitsProcessor(vocab)
    ids: list[int] = []
    for _ in range(max_steps):
        logits = proc(ids, torch.zeros(vocab.vocab_size))
        allowed = torch.nonzero(logits > float("-inf")).flatten().tolist()
        assert allowed, decode(ids)
        # prefer EOS and closing tokens now and then so that walks finish
        tid = eos if eos in allowed else rng.choice(allowed)
        if tid == eos:
            return decode(ids), True
        ids.append(tid)
    return decode(ids), False


def test_random_walks_over_masks_give_valid_json():
    tok = _CharTokenizer()
    vocab = JsonVocab(tok, len(tok), eos_token_id=0)
    rng = random.Random(0)
    finished = 0
    for _ in range(300):
        text, done = _random_walk(vocab, tok.decode, rng, 60, eos=0)
        assert advance_text(_INITIAL, text) is not None
        if done:
            assert isinstance(json.loads(text), dict), text
            finished += 1
    assert finished >= 30


def test_masks_match_brute_force_on_real_tokenizer():
    """The cached, bucketed mask equals simulating every token from the state."""
    from compilelm.models.loader import resolve_model
    from compilelm.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    vocab = JsonVocab(tok, 49152, tok.eos_token_id)
    for prefix in ['{', '{"na', '{"name": ', '{"a": [1, {"b": tr', '{"a": -1', '{"a": "x\\',
                   '{"a": {"b": [[', '{"a": 1}', '{"a": 12.5e']:
        state = advance_text(_INITIAL, prefix)
        fast = vocab.mask(state)
        slow = torch.tensor([t is not None and advance_text(state, t) is not None
                             for t in vocab.texts] + [False] * (49152 - len(vocab.texts)))
        if state[0] == ("END",):
            slow[tok.eos_token_id] = True
        assert torch.equal(fast, slow), prefix
    # EOS only when the object is complete
    assert vocab.mask(advance_text(_INITIAL, '{"a": 1}'))[tok.eos_token_id]
    assert not vocab.mask(advance_text(_INITIAL, '{"a": 1'))[tok.eos_token_id]
