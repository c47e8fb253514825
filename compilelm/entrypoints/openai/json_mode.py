"""`response_format: {"type": "json_object"}`: a logits processor that keeps the output a valid
JSON object prefix, and allows EOS only once the object is complete.

A character-level pushdown automaton tracks the output: a lexical state (in a string, after a
value, in a number, ...) plus a stack of open `{`/`[`. A token is allowed when all of its
characters (its decoded text) are valid from the current state. Masks depend only on the
lexical state and the top few stack entries (a token can close at most a few containers), so
each distinct state's mask is computed once per tokenizer and cached. Computing one is cheap:
inside a string every "plain" token (no quote, backslash or control character) is valid as a
precomputed class, and elsewhere only tokens whose first (non-space) character can start
something valid there are simulated.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, defaultdict

import torch

_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = "\"\\/bfnrt"
_VALUE_START = '{["-' + _DIGITS + "tfn"
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# number automaton: state -> {character class -> next state}; "end" states may stop here
_NUM = {"MINUS": {"zero": "ZERO", "digit": "INT"}, "ZERO": {"dot": "DOT", "exp": "E"},
        "INT": {"zero": "INT", "digit": "INT", "dot": "DOT", "exp": "E"},
        "DOT": {"zero": "FRAC", "digit": "FRAC"},
        "FRAC": {"zero": "FRAC", "digit": "FRAC", "exp": "E"},
        "E": {"sign": "ESIGN", "zero": "EXP", "digit": "EXP"},
        "ESIGN": {"zero": "EXP", "digit": "EXP"}, "EXP": {"zero": "EXP", "digit": "EXP"}}
_NUM_END = {"ZERO", "INT", "FRAC", "EXP"}
_NUM_FIRST = _DIGITS + ".eE+-" + _WS + ",}]"
# first characters (after optional whitespace) that can be valid in each structural state
_STRUCT_FIRST = {"START": "{", "OBJ_OPEN": '"}', "OBJ_KEY": '"', "COLON": ":",
                 "VALUE": _VALUE_START, "ARR_OPEN": _VALUE_START + "]", "AFTER": ",}]", "END": ""}
_INITIAL = (("START",), ())


def _num_class(ch: str) -> str | None:
    if ch == "0":
        return "zero"
    if ch in _DIGITS:
        return "digit"
    if ch in "eE":
        return "exp"
    if ch == ".":
        return "dot"
    return "sign" if ch in "+-" else None


def _after(stack: tuple) -> tuple:
    return ("END",) if not stack else ("AFTER",)


def advance(lex: tuple, stack: tuple, ch: str):
    """One character: (lex, stack) -> (lex, stack), or None if `ch` cannot come next."""
    kind = lex[0]
    if kind == "STR":
        if ch == '"':
            return (("COLON",) if lex[1] else _after(stack)), stack
        if ch == "\\":
            return ("ESC", lex[1]), stack
        return None if ord(ch) < 0x20 else (lex, stack)
    if kind == "ESC":
        if ch in _ESCAPES:
            return ("STR", lex[1]), stack
        return (("HEX", lex[1], 4), stack) if ch == "u" else None
    if kind == "HEX":
        if ch not in _HEX:
            return None
        return (("STR", lex[1]) if lex[2] == 1 else ("HEX", lex[1], lex[2] - 1)), stack
    if kind == "LIT":
        if ch != lex[1][0]:
            return None
        return (("LIT", lex[1][1:]) if len(lex[1]) > 1 else _after(stack)), stack
    if kind in _NUM:
        nxt = _NUM[kind].get(_num_class(ch))
        if nxt is not None:
            return (nxt,), stack
        return advance(_after(stack), stack, ch) if kind in _NUM_END else None
    if ch in _WS:
        return None if kind == "END" else (lex, stack)
    if kind == "START":
        return (("OBJ_OPEN",), stack + ("{",)) if ch == "{" else None
    if kind in ("OBJ_OPEN", "OBJ_KEY"):
        if ch == '"':
            return ("STR", True), stack
        if ch == "}" and kind == "OBJ_OPEN":
            return _after(stack[:-1]), stack[:-1]
        return None
    if kind == "COLON":
        return (("VALUE",), stack) if ch == ":" else None
    if kind in ("VALUE", "ARR_OPEN"):
        if ch == "]" and kind == "ARR_OPEN":
            return _after(stack[:-1]), stack[:-1]
        return _value_start(ch, stack)
    if kind == "AFTER":
        top = stack[-1]
        if ch == ",":
            return (("OBJ_KEY",) if top == "{" else ("VALUE",)), stack
        if (ch == "}" and top == "{") or (ch == "]" and top == "["):
            return _after(stack[:-1]), stack[:-1]
    return None


def _value_start(ch: str, stack: tuple):
    if ch == "{":
        return ("OBJ_OPEN",), stack + ("{",)
    if ch == "[":
        return ("ARR_OPEN",), stack + ("[",)
    if ch == '"':
        return ("STR", False), stack
    if ch == "-":
        return ("MINUS",), stack
    if ch in _DIGITS:
        return ("ZERO",) if ch == "0" else ("INT",), stack
    if ch in _LITERALS:
        return ("LIT", _LITERALS[ch]), stack
    return None


def advance_text(state, text: str):
    lex, stack = state
    for ch in text:
        nxt = advance(lex, stack, ch)
        if nxt is None:
            return None
        lex, stack = nxt
    return lex, stack


class JsonVocab:
    """A tokenizer's token texts, grouped for fast mask building, plus the mask cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, cache_size: int = 512):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        n = min(len(tokenizer), vocab_size)
        # decode each token after an anchor, so tokenizers that drop a leading space alone
        # (SentencePiece) still give the token's text in context
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1]
        prefix = tokenizer.decode([anchor])
        special = {i for i in getattr(tokenizer, "added_tokens_decoder", {})} | set(
            tokenizer.all_special_ids)
        texts = tokenizer.batch_decode([[anchor, i] for i in range(n)])
        self.texts: list[str | None] = [
            None if i in special or not t.startswith(prefix) or len(t) == len(prefix)
            else t[len(prefix):] for i, t in enumerate(texts)]
        self.plain_string = torch.zeros(vocab_size, dtype=torch.bool)
        self.string_special: list[int] = []
        self.by_first: dict[str, list[int]] = defaultdict(list)
        self.by_first_nonws: dict[str, list[int]] = defaultdict(list)
        self.all_ws: list[int] = []
        self.max_closers = 0
        for i, t in enumerate(self.texts):
            if t is None:
                continue
            if '"' in t or "\\" in t or any(ord(c) < 0x20 for c in t):
                self.string_special.append(i)
            else:
                self.plain_string[i] = True
            self.by_first[t[0]].append(i)
            stripped = t.lstrip(_WS)
            (self.by_first_nonws[stripped[0]] if stripped else self.all_ws).append(i)
            self.max_closers = max(self.max_closers, t.count("}") + t.count("]"))
        self.depth = self.max_closers + 1  # stack entries a token can look at
        self._cache: OrderedDict = OrderedDict()
        self._cache_size = cache_size

    def _candidates(self, lex: tuple) -> list[int]:
        kind = lex[0]
        if kind == "STR":
            return self.string_special
        if kind == "ESC":
            return [i for c in _ESCAPES + "u" for i in self.by_first.get(c, ())]
        if kind == "HEX":
            return [i for c in _HEX for i in self.by_first.get(c, ())]
        if kind == "LIT":
            return self.by_first.get(lex[1][0], [])
        if kind in _NUM:
            return [i for c in _NUM_FIRST for i in self.by_first.get(c, ())]
        if kind == "END":
            return []
        return self.all_ws + [i for c in _STRUCT_FIRST[kind] for i in self.by_first_nonws.get(c, ())]

    def mask(self, state) -> torch.Tensor:
        """bool [vocab_size]: the tokens that may come next in `state`."""
        lex, stack = state
        key = (lex, stack[-self.depth:], len(stack) > self.depth)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        mask = self.plain_string.clone() if lex[0] == "STR" else torch.zeros(self.vocab_size,
                                                                             dtype=torch.bool)
        # a deep stack is cut to its top entries: no token can pop below them
        short = (lex, stack[-self.depth:])
        for i in self._candidates(lex):
            if advance_text(short, self.texts[i]) is not None:
                mask[i] = True
        if lex[0] == "END" and self.eos_token_id is not None:
            mask[self.eos_token_id] = True
        self._cache[key] = mask
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return mask


class JsonObjectLogitsProcessor:
    """fn(output_token_ids, logits_row) -> logits_row. Shared by the `n` sequences of one
    request, so states are looked up by output prefix (and recomputed if not found)."""

    def __init__(self, vocab: JsonVocab):
        self.vocab = vocab
        self._states: dict[int, dict[tuple, tuple]] = {0: {(): _INITIAL}}  # length -> prefix -> state

    def _state(self, ids: list[int]):
        n = len(ids)
        key = tuple(ids)
        state = self._states.get(n, {}).get(key)
        if state is not None:
            return state
        prev = self._states.get(n - 1, {}).get(key[:-1]) if n else None
        if prev is not None:
            state = self._advance(prev, ids[-1])
        else:  # not seen (e.g. after preemption): replay from the start
            state = _INITIAL
            for t in ids:
                state = self._advance(state, t)
        self._states.setdefault(n, {})[key] = state
        for old in [k for k in self._states if k < n - 1]:
            del self._states[old]
        return state

    def _advance(self, state, token_id: int):
        text = self.vocab.texts[token_id] if token_id < len(self.vocab.texts) else None
        nxt = advance_text(state, text) if text is not None else None
        return nxt if nxt is not None else state  # EOS, or a token forced past the mask

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        # logits: fp32 [vocab]
        mask = self.vocab.mask(self._state(output_token_ids))
        if mask.device != logits.device:
            mask = mask.to(logits.device)
        if mask.shape[0] != logits.shape[-1]:  # the model's vocab is padded past the tokenizer's
            mask = torch.nn.functional.pad(mask, (0, logits.shape[-1] - mask.shape[0]))
        return torch.where(mask, logits, torch.tensor(float("-inf"), device=logits.device))


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> JsonVocab


def json_object_processor(engine) -> JsonObjectLogitsProcessor:
    """A fresh processor for one request; the vocabulary tables are built once per engine."""
    vocab = _VOCABS.get(engine)
    if vocab is None:
        vocab = _VOCABS[engine] = JsonVocab(engine.tokenizer, engine.model_config.vocab_size,
                                                engine.eos_token_id)
    return JsonObjectLogitsProcessor(vocab)
