"""Request and response models of the OpenAI-compatible API (OpenAI's fields + vLLM's extras).

Requests accept unknown fields (openai-python sends `extra_body` keys at the top level; they are
reported by ignored_fields.py, as vLLM reports them) but check every known field's type and range
here, so the generated /openapi.json is exact and a bad value is a 400 before anything reaches
the engine. Non-finite floats are refused, and so is every string that is not valid Unicode (JSON
lets a body carry a lone surrogate, `"\\ud800"`, which no tokenizer or UTF-8 encoder takes): a 400
naming the field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

MAX_N = 128  # choices per prompt (an unbounded n is a DoS: CVE-2026-34756)
MAX_SEQS_PER_REQUEST = 256  # prompts x n of one HTTP request
MAX_PROMPTS = 128  # prompts in one /v1/completions batch
MAX_LOGPROBS = 20
MAX_STOP = 16  # stop strings per request
_INT64 = 2**63
# pydantic checks that a string is valid Unicode only when it has a constraint: this bound puts
# one on every string field (and dict key) of the requests; the body-size limit binds first
_MAX_STR_CHARS = 2**31 - 1

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, str_max_length=_MAX_STR_CHARS)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class JsonSchemaFormat(OpenAIBaseModel):
    """response_format's `json_schema`: the schema under `schema` (as OpenAI sends it)."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag (vLLM's form): tagged regions of free text
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError('response_format of type "json_schema" needs json_schema.schema')
        if self.type == "structural_tag" and not (self.structures and self.triggers):
            raise ValueError('response_format of type "structural_tag" needs "structures" and "triggers"')
        return self


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` request field (one constraint; the options below it)."""

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions (all optional)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=1e4)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64 - MAX_N)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=1e4)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=1024)] | None = None
    user: str | None = None
    # structured outputs: vLLM's field, OpenAI's response_format, and vLLM's older guided_* extras
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted; the backend is always llguidance
    # vLLM's: lower runs earlier under --scheduling-policy priority, which compilelm does not have
    # (FCFS only): 0 is accepted, anything else is refused as vLLM refuses it under FCFS
    priority: int = Field(0, ge=0, le=0)

    @field_validator("priority", mode="before")
    @classmethod
    def _no_priority_scheduling(cls, value):
        if isinstance(value, int) and not isinstance(value, bool) and value != 0:
            raise ValueError(f"Got priority {value} but priority scheduling is not enabled (compilelm "
                             "schedules first come, first served)")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self


class CompletionRequest(_SamplingRequest):
    prompt: (Annotated[str, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: int | None = Field(16, ge=1, le=2**31 - 1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(OpenAIBaseModel):
    """An earlier assistant turn's tool call, sent back in `messages`."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=1024)] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers
    reasoning_content: str | None = None  # assistant: its reasoning (templates may render it)
    reasoning: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)  # deprecated by OpenAI, still sent
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[ChatCompletionTool], Field(max_length=1024)] | None = None
    # unset: "auto" when there are tools (a 400 unless the server runs --enable-auto-tool-choice)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # extra variables for the chat template (e.g. {"enable_thinking": false} for Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` requires `logprobs` to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("`continue_final_message` needs `add_generation_prompt` set to false")
        return self


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ChatCompletionTool], Field(max_length=1024)] | None = None
    return_token_strs: bool = False


def _tokenize_form(body) -> str:
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body \
        else "TokenizeCompletionRequest"


# /tokenize's body: the chat form when it has `messages` (errors then name that form's fields)
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
                            | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
                            Discriminator(_tokenize_form)]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


# -- responses ---------------------------------------------------------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = []


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # the text inside <think>...</think> with --reasoning-parser (`reasoning` is vLLM's newer name)
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "compilelm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's configuration (tokenizer_config.json's fields), as vLLM serves it."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class VersionResponse(BaseModel):
    version: str
