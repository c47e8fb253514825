"""POST /v1/chat/completions: the model's chat template, `max_completion_tokens`/`max_tokens`,
`logprobs`/`top_logprobs`, `response_format` json_object, streaming in OpenAI's chunk format.

Streaming: the first chunk of each choice carries `role`, content follows as `delta.content`,
`finish_reason` is set in exactly one chunk per choice, an optional usage chunk with
`choices: []` comes last, then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from compilelm.entrypoints.openai.errors import OpenAIError, bad_request, sse_error_event
from compilelm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatResponseMessage,
    UsageInfo,
)
from compilelm.entrypoints.openai.serving_engine import (
    ChoiceStream,
    OpenAIServing,
    clamp_logprob,
    holdback_for,
    random_id,
)
from compilelm.models.tokenizer import apply_chat_template
from compilelm.runtime.async_engine import RequestStream

# template variables a request sets through its own fields, or the server alone
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                     "continue_final_message", "chat_template", "tokenize"})


class OpenAIServingChat(OpenAIServing):
    def render(self, messages, add_generation_prompt: bool, continue_final_message: bool,
               template_kwargs: dict | None = None) -> list[int]:
        """Messages -> prompt token ids through the model's (sandboxed) chat template;
        `template_kwargs` (the request's chat_template_kwargs) are variables of the template."""
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
            conversation.append(msg)
        kwargs = dict(template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            return apply_chat_template(self.engine.tokenizer, conversation,
                                       add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault
            raise bad_request(f"cannot apply the chat template: {e}", param="messages") from e

    def prepare(self, req: ChatCompletionRequest) -> tuple[str, list[int], RequestStream]:
        """Validate, render and admit: (request id, prompt ids, stream)."""
        self.check_model(req.model)
        if req.tools and req.tool_choice != "none":
            raise bad_request("tool calling is not supported", param="tools")
        self.admit(req.n)
        ids = self.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                          req.chat_template_kwargs)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        max_tokens = self.check_prompt(ids, max_tokens, param="messages")
        extra = {}
        if req.response_format is not None and req.response_format.type != "text":
            extra["logits_processors"] = [self._json_processor(req.response_format.type)]
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs, **extra)
        request_id = random_id("chatcmpl")
        return request_id, ids, self.start(request_id, ids, params)

    def _json_processor(self, kind: str):
        if kind != "json_object":
            raise bad_request(f"response_format {kind!r} is not supported (use json_object)",
                              param="response_format")
        from compilelm.entrypoints.openai.json_mode import json_object_processor
        return json_object_processor(self.engine)

    async def complete(self, req: ChatCompletionRequest, request_id: str, ids: list[int],
                       stream: RequestStream) -> ChatCompletionResponse:
        final = None
        async for out in self.iterate(stream):
            final = out
        choices, completion_tokens = [], 0
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            logprobs = self._logprobs(c.token_ids, c.logprobs, req) if req.logprobs else None
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=ChatResponseMessage(content=c.text), logprobs=logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                          total_tokens=len(ids) + completion_tokens)
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=usage)

    async def stream(self, req: ChatCompletionRequest, request_id: str, ids: list[int],
                     stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n = stream.num_seqs
        streams = [ChoiceStream(holdback_for(stream.params)) for _ in range(n)]
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
                    logprobs = None
                    if req.logprobs:
                        logprobs = self._logprobs(delta.token_ids, delta.logprobs, req).model_dump()
                    if delta.finish_reason is not None:
                        completion_tokens += len(c.token_ids)
                    yield chunk([{"index": c.index,
                                  "delta": {"content": delta.text} if delta.text else {},
                                  "logprobs": logprobs, "finish_reason": delta.finish_reason,
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
