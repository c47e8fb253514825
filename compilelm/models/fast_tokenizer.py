"""A tokenizer straight on the `tokenizers` (Rust) library plus jinja2 chat templates.

`from transformers import AutoTokenizer` costs seconds at every start (it imports half of the
Hugging Face stack), while serving only needs encode, decode and the chat template. For a directory
with `tokenizer.json`, transformers' fast tokenizer (v5 `TokenizersBackend`) is itself a thin layer
over the same Rust object; this class reproduces the parts compilelm uses:

- encode: the Rust pipeline with tokenizer.json's post-processor (BOS/EOS come from there: with a
  tokenizer.json, transformers drops tokenizer_config's add_bos_token/add_eos_token), truncation
  and padding off, named special tokens registered as special added tokens like transformers does.
- decode: the Rust decoder, `skip_special_tokens` as given; `spaces_between_special_tokens` is
  accepted and ignored, as fast tokenizers do; `clean_up_tokenization_spaces` from the config,
  skipped for BPE models like transformers v5.
- apply_chat_template(tokenize=False): transformers' jinja environment (sandboxed, trim_blocks,
  lstrip_blocks, loopcontrols, `{% generation %}`, tojson, raise_exception, strftime_now) and
  variables (messages with None fields dropped, tools, documents, add_generation_prompt,
  the special tokens by name, extra kwargs), and continue_final_message.

Where it differs from transformers (so `load_tokenizer` uses transformers there instead, or the
difference is accepted): directories without tokenizer.json (sentencepiece/tiktoken files need
transformers' converters); transformers v5 model classes with their own `__init__`
(LlamaTokenizer, GPT2Tokenizer, ...) rebuild the pre-tokenizer/decoder in Python code and keep
only vocab, merges and post-processor of tokenizer.json, while this follows tokenizer.json as
written (as `tokenizers`, TGI and transformers v4 do) -- the same for well-formed files; remote-code
tokenizers; `apply_chat_template(tokenize=True)` returns a list of ids, not a BatchEncoding;
templates that call Python tool functions (tools must be JSON schemas here).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

from tokenizers import AddedToken, Tokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (all_special_ids follows it)
_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_added_token(value) -> AddedToken:
    """A special token from tokenizer_config: a string, or a serialized AddedToken dict."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    fields = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
    return AddedToken(value["content"], special=True, **fields)


class FastTokenizer:
    """transformers' fast tokenizer, reduced to what compilelm calls (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.name_or_path = path
        self._tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        config = {**_read_json(os.path.join(path, "special_tokens_map.json")),
                  **_read_json(os.path.join(path, "tokenizer_config.json"))}
        # named special tokens: the standard ones, then model-specific `*_token` keys
        named = {k: config[k] for k in _SPECIAL_ATTRS if config.get(k) is not None}
        named.update({k: v for k, v in config.items() if k.endswith("_token") and k not in named
                      and (isinstance(v, str) or (isinstance(v, dict) and "content" in v))})
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
        if isinstance(extra, dict):  # named model-specific tokens
            named.update(extra)
            extra = []
        added = [_as_added_token(v) for v in [*named.values(), *extra]]
        if added:  # transformers registers them all as special added tokens after loading
            self._tokenizer.add_special_tokens(added)
        self.special_tokens_map: dict[str, str] = {k: _as_added_token(v).content for k, v in named.items()}
        self.all_special_tokens: list[str] = list(dict.fromkeys(
            [*self.special_tokens_map.values(), *(t.content for t in added[len(named):])]))
        self.all_special_ids: list[int] = [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._is_bpe = type(self._tokenizer.model).__name__ == "BPE"
        self.chat_template = self._load_chat_template(path, config)

    @staticmethod
    def _load_chat_template(path: str, config: dict) -> str | dict | None:
        """chat_template.jinja (and additional_chat_templates/*.jinja) take priority over the
        `chat_template` entry of tokenizer_config (a string, or a list of named templates)."""
        templates = {}
        extra_dir = os.path.join(path, "additional_chat_templates")
        if os.path.isdir(extra_dir):
            for name in sorted(os.listdir(extra_dir)):
                if name.endswith(".jinja"):
                    with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                        templates[name[: -len(".jinja")]] = f.read()
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                templates["default"] = f.read()
        elif isinstance(config.get("chat_template"), list):
            templates.update({t["name"]: t["template"] for t in config["chat_template"]})
        elif isinstance(config.get("chat_template"), str):
            templates["default"] = config["chat_template"]
        if not templates:
            return None
        return templates["default"] if list(templates) == ["default"] else templates

    # --- special tokens -------------------------------------------------------------------------

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    # --- vocabulary -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._tokenizer.get_added_tokens_decoder()

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int | None] | None:
        if isinstance(tokens, str):
            index = self._tokenizer.token_to_id(tokens)
            return index if index is not None else self.unk_token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # --- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None,
               spaces_between_special_tokens: bool = True) -> str:
        """`spaces_between_special_tokens` only matters to transformers' slow tokenizers."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._clean_up(text, clean_up_tokenization_spaces)

    def batch_decode(self, sequences, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None, **kwargs) -> list[str]:
        texts = self._tokenizer.decode_batch([list(s) for s in sequences],
                                             skip_special_tokens=skip_special_tokens)
        return [self._clean_up(t, clean_up_tokenization_spaces) for t in texts]

    def _clean_up(self, text: str, clean_up: bool | None) -> str:
        """transformers' clean_up_tokenization, which v5 never applies to BPE models."""
        if not (self.clean_up_tokenization_spaces if clean_up is None else clean_up) or self._is_bpe:
            return text
        for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                     (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
            text = text.replace(a, b)
        return text

    # --- chat template --------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                name = "tool_use" if tools is not None and "tool_use" in templates else "default"
                if name not in templates:
                    raise ValueError(f"this model has several chat templates and no default: "
                                     f"pass one of {sorted(templates)} as chat_template")
                return templates[name]
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this tokenizer has no chat template (tokenizer.chat_template is not set)")
        return templates

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            **kwargs) -> str | list[int]:
        template = self.get_chat_template(chat_template, tools)
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        # transformers drops the keys whose value is None (OpenAI clients send content=None)
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        final = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final = messages[-1].get(field)
            if not isinstance(final, str):
                raise ValueError(f'continue_final_message is set but the final message has no text "{field}"')
            if field not in template:
                raise ValueError(f'continue_final_message: the chat template never reads "{field}"')
            messages[-1][field] = final + _CONTINUE_TAG
        text = _compile_template(template).render(
            messages=messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        if final is not None:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ValueError("continue_final_message is set but the chat template drops the "
                                 "final message")
            at = text.rindex(tag)
            # a template that strips the message also strips the tag's space: strip like it
            text = text[:at] if text[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return self.encode(text, add_special_tokens=False) if tokenize else text


@lru_cache
def _compile_template(source: str):
    """transformers' chat-template environment (utils/chat_template_utils.py)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        rendering keeps its body as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which chat templates must not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
