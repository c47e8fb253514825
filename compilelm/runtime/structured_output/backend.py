"""GuidanceBackend: one engine's grammar compiler on llguidance.

The tokenizer is turned into llguidance's token trie once (about 0.3 s for a 49k vocabulary; on
first use, under a lock). A constraint compiles to a pristine matcher, kept in an LRU cache keyed
by the constraint, so a schema that every request repeats compiles once; each request gets a
copy of it (`matcher`). Compiles run in a small thread pool (`compile_async`): llguidance drops
the GIL while it builds a grammar, so the engine thread keeps stepping and no other stream waits
for a new schema. The server compiles there before admitting a request (a bad grammar is a 400);
the engine's `matcher` then finds it in the cache, and compiles on its own thread only for the
offline API (or after an eviction).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict

from compilelm.runtime.structured_output.bitmask import MaskFiller
from compilelm.runtime.structured_output.grammar_spec import GrammarError, grammar_text
from compilelm.sampling_params import StructuredOutputsParams

_CACHE_SIZE = 256  # compiled constraints kept
_COMPILE_THREADS = 2


class GuidanceBackend:
    """`tokenizer`: the engine's (FastTokenizer, or a transformers fast tokenizer); `vocab_size`:
    the model's logits width; `eos_token_ids`: every id that ends a request (the grammar allows
    them once its value is complete). `mask_threads` (class default): the threads of llguidance's
    mask executor, None for its default (80% of the CPUs, at most 32)."""

    mask_threads: int | None = None

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t is not None]
        self._ll_tokenizer = None
        self._lock = threading.Lock()  # guards the tokenizer's construction and the cache
        self._cache: OrderedDict[str, object] = OrderedDict()  # key -> pristine LLMatcher
        self._pool = concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="compilelm-grammar")
        self._executor = None  # llguidance's mask threads, made on the first mask
        self._filler: MaskFiller | None = None

    # -- compiling -----------------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams):
        """The pristine matcher of `params` (cached); raises GrammarError."""
        key = _key(params)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        import llguidance

        tokenizer = self.ll_tokenizer()
        grammar = grammar_text(params)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)  # compiles without the GIL
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        with self._lock:
            self._cache[key] = matcher
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def compile_async(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """`compile` on the backend's threads (wrap with asyncio.wrap_future to await it)."""
        return self._pool.submit(self.compile, params)

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for one request (a copy of the cached compile)."""
        return self.compile(params).deep_copy()

    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (raises GrammarError for one it cannot read)."""
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = _ll_tokenizer(self._tokenizer, self.vocab_size, self.eos_token_ids)
                except GrammarError:
                    raise
                except Exception as e:  # noqa: BLE001 - e.g. a decoder llguidance does not model
                    raise GrammarError(f"structured outputs cannot use this tokenizer: {e}") from e
            return self._ll_tokenizer

    @property
    def mask_vocab(self) -> int:
        """The width of a mask row in tokens (>= the model's vocabulary)."""
        return self.ll_tokenizer().vocab_size

    def mask_executor(self):
        if self._executor is None:
            import llguidance
            self._executor = llguidance.LLExecutor(self.mask_threads)
        return self._executor

    def mask_filler(self, pin: bool) -> MaskFiller:
        """The mask thread and its reused buffer (pinned for a GPU), made on the first mask."""
        if self._filler is None:
            self._filler = MaskFiller(self.mask_executor(), self.mask_vocab, pin)
        return self._filler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._filler is not None:
            self._filler.shutdown()


def _ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    import llguidance

    if not eos_token_ids:
        raise GrammarError("structured outputs need an end-of-sequence token, and this tokenizer has none")
    backend = getattr(tokenizer, "_tokenizer", None)  # FastTokenizer: the `tokenizers` object itself
    if backend is not None and hasattr(backend, "to_str"):
        n_tokens = backend.get_vocab_size(with_added_tokens=True)
        eos = _tokenizer_eos(eos_token_ids, n_tokens)
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=max(vocab_size, n_tokens), eos_token=eos)
    if hasattr(tokenizer, "backend_tokenizer"):  # a transformers fast tokenizer
        from llguidance.hf import from_tokenizer
        eos = _tokenizer_eos(eos_token_ids, len(tokenizer))
        return from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=eos)
    raise GrammarError(f"structured outputs need a fast (tokenizer.json) tokenizer; this model has "
                       f"{type(tokenizer).__name__}")


def _tokenizer_eos(eos_token_ids: list[int], n_tokens: int) -> list[int]:
    """The end-of-sequence ids llguidance is given: the request-ending ids that are among the
    tokenizer's `n_tokens` (a model config may name ids past a tokenizer it shares, e.g. a
    random-weight shape run with another model's tokenizer; those ids stay masked off)."""
    known = [t for t in eos_token_ids if 0 <= t < n_tokens]
    if not known:
        raise GrammarError(f"structured outputs need an end-of-sequence token of the tokenizer's {n_tokens}; "
                           f"the model's {eos_token_ids} are all outside it")
    return known


def _key(params: StructuredOutputsParams) -> str:
    return json.dumps([params.kind, params.json, params.regex, params.choice, params.grammar, params.structural_tag,
                       params.disable_any_whitespace, params.disable_additional_properties,
                       params.whitespace_pattern], sort_keys=True, default=str)


def _first_line(message: str) -> str:
    """llguidance's errors append the parser's state; the first lines say what is wrong."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:4])[:500] if lines else "the grammar does not compile"
