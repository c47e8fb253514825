"""Token ids -> text, one step at a time, plus the stop-string check.

Decoding the whole output every step is quadratic, and decoding each token alone breaks
multi-byte characters (an emoji is often 2-4 byte-level tokens) and tokenizers that look at the
left context (SentencePiece's leading space). So each step decodes a small window of ids twice:
the part whose text was already emitted (the prefix) and the whole window; the new text is the
difference. While the window's text ends in U+FFFD (an unfinished UTF-8 character) nothing is
emitted and the window grows until the character is complete. In steady decoding the prefix is the
single id emitted last; the text of single ids is cached per tokenizer and decode options.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from compilelm.outputs import Logprob

if TYPE_CHECKING:
    from compilelm.runtime.sampler import LogprobsLists

# Prompt tokens the first window starts with, so the first output token has left context.
_INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# tokenizer -> (skip_special_tokens, spaces_between_special_tokens) -> {id: text of that id alone}
_SINGLE_ID_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    """`tokenizer` is a Hugging Face fast tokenizer (anything with `decode(ids, ...)`)."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # window[:read_offset] is the prefix (its text was emitted or is prompt text);
        # window[read_offset:] are tokens whose text is still held back.
        self._window = list(prompt_token_ids[-_INITIAL_PREFIX_TOKENS:])
        self._read_offset = len(self._window)
        self._output_text = ""
        self._streamed_len = 0  # chars handed out by get_next_output_text
        # id -> decode([id]), shared by the detokenizers of one tokenizer and set of options
        try:
            per_options = _SINGLE_ID_TEXT.setdefault(tokenizer, {})
        except TypeError:  # not weak-referenceable: a cache of its own
            per_options = {}
        self._single = per_options.setdefault((skip_special_tokens, spaces_between_special_tokens), {})

    @property
    def output_text(self) -> str:
        return self._output_text

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append generated tokens; return the text they completed (may be empty)."""
        if len(new_token_ids) > 1:  # many at once (a request detokenized when it finishes)
            text = self._add_many(new_token_ids)
            if text is not None:
                return text
        delta = []
        for token_id in new_token_ids:
            self._window.append(token_id)
            prefix_text = self._prefix_text()
            full_text = self._decode(self._window)
            if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT_CHAR):
                delta.append(full_text[len(prefix_text) :])
                # the new prefix is what was just read; older ids are no longer needed
                self._window = self._window[self._read_offset :]
                self._read_offset = len(self._window)
        text = "".join(delta)
        self._output_text += text
        return text

    def _add_many(self, new_token_ids: list[int]) -> str | None:
        """All of `new_token_ids` in one decode of the window; None (nothing changed) if that text
        ends in an unfinished character, where the token-by-token path emits what it can."""
        window = self._window + list(new_token_ids)
        prefix_text = self._prefix_text()
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return None
        text = full_text[len(prefix_text) :]
        # the last ids are the next window's prefix: left context, like the prompt's tail at first
        self._window = window[-_INITIAL_PREFIX_TOKENS:]
        self._read_offset = len(self._window)
        self._output_text += text
        return text

    def _prefix_text(self) -> str:
        """The text of window[:read_offset] (a single id's from the cache)."""
        if self._read_offset != 1:
            return self._decode(self._window[: self._read_offset])
        text = self._single.get(self._window[0])
        if text is None:
            text = self._single[self._window[0]] = self._decode(self._window[:1])
        return text

    def truncate(self, length: int) -> None:
        """Cut the output text (after a stop string matched)."""
        self._output_text = self._output_text[:length]

    def get_next_output_text(self, finished: bool, stop_buffer_length: int = 0) -> str:
        """The text not streamed yet, holding back the last `stop_buffer_length` characters
        until the request finishes, so that a half-matched stop string is never streamed
        (pass max(len(s) for s in stop) - 1 when stop strings are excluded from the output)."""
        end = len(self._output_text) - (0 if finished else stop_buffer_length)
        if end <= self._streamed_len:
            return ""
        text, self._streamed_len = self._output_text[self._streamed_len : end], end
        return text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that the last `new_char_count` characters completed.

    Only the tail that can hold such a match is searched: a stop string of length L ending in
    the new text starts at most L - 1 characters before it. Returns (stop string, length to
    truncate the output text to) for the match that starts first, else None.
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    return stop_str, index + len(stop_str) if include_stop_str_in_output else index


def detokenize_logprobs(tokenizer, lists: LogprobsLists) -> dict[int, Logprob]:
    """Sampler logprobs of one position -> {token id: Logprob} with each token's own text.

    The sampled token comes first and keeps its entry if it is also among the top tokens.
    """
    out: dict[int, Logprob] = {}
    for token_id, logprob, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
        if token_id not in out:
            out[token_id] = Logprob(logprob, rank, tokenizer.decode([token_id]))
    return out
