"""POST /v1/chat/completions: the model's chat template (with `tools`, earlier `tool_calls` and
`tool` messages), `max_completion_tokens`/`max_tokens`, `logprobs`/`top_logprobs`, structured
outputs (structured_outputs.py), tool calls (`tool_choice` none / auto with --tool-call-parser /
required / a named function), reasoning (--reasoning-parser), streaming in OpenAI's chunk format.

Streaming: the first chunk of each choice carries `role`; reasoning, content and tool calls follow
as `delta.reasoning_content`, `delta.content` and `delta.tool_calls` (chat_output.py);
`finish_reason` is set in exactly one chunk per choice ("tool_calls" when an auto or required
choice called tools), an optional usage chunk with `choices: []` comes last, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from compilelm.entrypoints.openai.chat_output import ChoiceOutput
from compilelm.entrypoints.openai.errors import OpenAIError, bad_request, sse_error_event
from compilelm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatResponseMessage,
    NamedToolChoice,
    UsageInfo,
)
from compilelm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from compilelm.entrypoints.openai.serving_engine import (
    ChoiceStream,
    OpenAIServing,
    clamp_logprob,
    holdback_for,
    random_id,
)
from compilelm.entrypoints.openai.structured_outputs import compile_constraint, requested_constraint
from compilelm.entrypoints.openai.tool_choice import (
    NamedToolOutput,
    RequiredToolOutput,
    named_tool_constraint,
    required_tools_constraint,
)
from compilelm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from compilelm.models.tokenizer import apply_chat_template
from compilelm.runtime.async_engine import RequestStream

# template variables a request sets through its own fields, or the server alone
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                     "continue_final_message", "chat_template", "tokenize"})


@dataclass
class ChatJob:
    request_id: str
    prompt_ids: list[int]
    stream: RequestStream
    tool_mode: str  # "none", "auto", "required" or "named"
    outputs: list[ChoiceOutput] = field(default_factory=list)  # one per choice (n)


class OpenAIServingChat(OpenAIServing):
    def render(self, messages, add_generation_prompt: bool, continue_final_message: bool,
               template_kwargs: dict | None = None, tools: list | None = None) -> list[int]:
        """Messages -> prompt token ids through the model's (sandboxed) chat template;
        `template_kwargs` (the request's chat_template_kwargs) are variables of the template, and
        `tools` (ChatCompletionTool models) its `tools`. An assistant message's tool calls reach
        the template with their arguments as objects (as Hugging Face templates expect)."""
        reserved = sorted(set(template_kwargs or ()) & _RESERVED_TEMPLATE_VARS)
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)} (request fields or "
                              "fixed by the server)", param="chat_template_kwargs")
        conversation = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"content part type {part.type!r} is not supported "
                                          f"(text only)", param=f"messages.{i}.content.{j}")
                    parts.append(part.text)
                content = "".join(parts)
            msg = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                    "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            conversation.append(msg)
        kwargs = dict(template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        if tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        try:
            return apply_chat_template(self.engine.tokenizer, conversation,
                                       add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e

    def _tool_mode(self, req: ChatCompletionRequest) -> str:
        """none / auto / required / named, checked against the request's tools and the server's flags."""
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if req.tools else "none"
        if choice != "none" and not req.tools:
            raise bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in req.tools]
            if choice.function.name not in names:
                raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not one of "
                                  f"`tools` ({', '.join(names)})", param="tool_choice")
            return "named"
        if choice == "auto" and self.state.tool_call_parser is None:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              'set (or send tool_choice "none", "required" or a named function)', param="tool_choice")
        return choice

    async def prepare(self, req: ChatCompletionRequest) -> ChatJob:
        """Validate, compile the request's grammar (off the event loop), render and admit."""
        self.check_model(req.model)
        tool_mode = self._tool_mode(req)
        constraint = requested_constraint(req)
        if tool_mode in ("named", "required"):
            if constraint is not None:
                raise bad_request(f'tool_choice "{tool_mode}" constrains the output already; it cannot be '
                                  f"combined with {constraint[1]}", param=constraint[1])
            if tool_mode == "named":
                function = next(t.function for t in req.tools if t.function.name == req.tool_choice.function.name)
                constraint = named_tool_constraint(function), "tool_choice"
            else:
                constraint = required_tools_constraint(req.tools, req.parallel_tool_calls), "tools"
        if constraint is not None:
            await compile_constraint(self.engine, *constraint)  # before admission: nothing awaits after it
        self.admit(req.n)
        ids = self.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                          req.chat_template_kwargs, req.tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        max_tokens = self.check_prompt(ids, max_tokens, param="messages")
        extra = {} if constraint is None else {"structured_outputs": constraint[0]}
        if tool_mode == "auto":  # the parsers' tags may be special tokens
            extra["skip_special_tokens"] = False
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs, **extra)
        request_id = random_id("chatcmpl")
        job = ChatJob(request_id, ids, self.start(request_id, ids, params), tool_mode)
        job.outputs = [self._choice_output(req, tool_mode, constraint is not None) for _ in range(req.n)]
        return job

    def _choice_output(self, req: ChatCompletionRequest, tool_mode: str, constrained: bool) -> ChoiceOutput:
        # a constrained output reasons first where the engine gates its grammar by the reasoning tags;
        # else it follows its grammar from the first token and has no reasoning part
        reasoning = None
        if self.state.reasoning_parser is not None and (not constrained or self.engine.reasoning_gate is not None):
            reasoning = REASONING_PARSERS[self.state.reasoning_parser]()
        tools = None
        if tool_mode == "named":
            tools = NamedToolOutput(req.tool_choice.function.name)
        elif tool_mode == "required":
            tools = RequiredToolOutput()
        elif tool_mode == "auto":
            tools = TOOL_PARSERS[self.state.tool_call_parser](req.tools)
        return ChoiceOutput(reasoning, tools, single_call=tool_mode == "auto" and not req.parallel_tool_calls)

    @staticmethod
    def _finish_reason(job: ChatJob, output: ChoiceOutput, reason: str | None) -> str | None:
        if reason == "stop" and job.tool_mode in ("auto", "required") and output.called_tools:
            return "tool_calls"
        return reason

    async def complete(self, req: ChatCompletionRequest, job: ChatJob) -> ChatCompletionResponse:
        final = None
        async for out in self.iterate(job.stream):
            final = out
        choices, completion_tokens = [], 0
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            logprobs = self._logprobs(c.token_ids, c.logprobs, req) if req.logprobs else None
            output = job.outputs[c.index]
            m = output.message(c.text)
            message = ChatResponseMessage(content=m.content, reasoning_content=m.reasoning, reasoning=m.reasoning,
                                          tool_calls=m.tool_calls)
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=logprobs,
                finish_reason=self._finish_reason(job, output, c.finish_reason), stop_reason=c.stop_reason))
        ids = job.prompt_ids
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                          total_tokens=len(ids) + completion_tokens)
        return ChatCompletionResponse(id=job.request_id, model=self.model_name, choices=choices,
                                      usage=usage)

    async def stream(self, req: ChatCompletionRequest, job: ChatJob) -> AsyncIterator[str]:
        created = int(time.time())
        request_id, ids, stream = job.request_id, job.prompt_ids, job.stream
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n = stream.num_seqs
        streams = [ChoiceStream(holdback_for(stream.params)) for _ in range(n)]
        texts = [""] * n
        completion_tokens = 0

        def chunk(choices: list[dict], usage=None) -> str:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None} for i in range(n)])
            async for out in self.iterate(stream, finish_aborted=True):
                for c in out.outputs:
                    delta = streams[c.index].next(c)
                    if delta is None:
                        continue
                    texts[c.index] += delta.text
                    output = job.outputs[c.index]
                    finished = delta.finish_reason is not None
                    fields = output.delta(texts[c.index], final=finished)
                    if not fields and not finished and not (req.logprobs and delta.token_ids):
                        continue
                    logprobs = None
                    if req.logprobs:
                        logprobs = self._logprobs(delta.token_ids, delta.logprobs, req).model_dump()
                    if finished:
                        completion_tokens += len(c.token_ids)
                    yield chunk([{"index": c.index, "delta": fields, "logprobs": logprobs,
                                  "finish_reason": self._finish_reason(job, output, delta.finish_reason),
                                  "stop_reason": delta.stop_reason}])
            if include_usage:
                usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                  total_tokens=len(ids) + completion_tokens)
                yield chunk([], usage.model_dump())
        except OpenAIError as e:
            yield sse_error_event(e)
        yield "data: [DONE]\n\n"

    @staticmethod
    def _logprobs(token_ids: list[int], logprobs: list | None, req) -> ChatCompletionLogProbs:
        content = []
        num_top = req.top_logprobs or 0
        for tid, lp in zip(token_ids, logprobs or []):
            entry = lp[tid]
            top = sorted(lp.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 0)
            content.append(ChatCompletionLogProbsContent(
                token=entry.decoded_token or "", logprob=clamp_logprob(entry.logprob),
                bytes=list((entry.decoded_token or "").encode()),
                top_logprobs=[ChatCompletionLogProb(token=v.decoded_token or "",
                                                    logprob=clamp_logprob(v.logprob),
                                                    bytes=list((v.decoded_token or "").encode()))
                              for _, v in top[:num_top]]))
        return ChatCompletionLogProbs(content=content)


def _arguments_object(arguments: str):
    """A tool call's JSON arguments as the object templates render (the text if it is not JSON)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
