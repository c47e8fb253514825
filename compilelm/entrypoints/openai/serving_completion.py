"""POST /v1/completions: string, string-list, token-id and token-id-list prompts; `echo`, legacy
`logprobs` (with prompt logprobs when echoing, as lm-evaluation-harness's loglikelihood needs).

Choice `index` is `prompt_index * n + i`, as in OpenAI's API.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from compilelm.entrypoints.openai.errors import OpenAIError, bad_request, sse_error_event
from compilelm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
)
from compilelm.entrypoints.openai.serving_engine import (
    ChoiceStream,
    OpenAIServing,
    clamp_logprob,
    holdback_for,
    random_id,
)
from compilelm.entrypoints.openai.structured_outputs import compile_constraint, requested_constraint
from compilelm.outputs import RequestOutput
from compilelm.runtime.async_engine import RequestStream
from compilelm.sampling_params import SamplingParams


@dataclass
class _Job:
    request_id: str
    prepared: list[tuple[str | None, list[int], SamplingParams]]  # (prompt text, ids, params)
    streams: list[RequestStream]


class OpenAIServingCompletion(OpenAIServing):
    async def prepare(self, req: CompletionRequest) -> _Job:
        """Validate, compile the request's grammar (off the event loop), tokenize and admit: one
        engine request per prompt."""
        self.check_model(req.model)
        constraint = requested_constraint(req)
        if constraint is not None:
            await compile_constraint(self.engine, *constraint)  # before admission: nothing awaits after it
        if req.suffix is not None:
            raise bad_request("`suffix` is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("`best_of` different from `n` is not supported", param="best_of")
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        self.admit(len(prompt) * req.n)
        prepared = []
        for p in prompt:
            if isinstance(p, str):
                ids = self.engine.tokenizer.encode(p, add_special_tokens=True) if p else []
                text = p
            else:
                ids, text = list(p), None
            max_tokens = self.check_prompt(ids, req.max_tokens)
            echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
            params = self.sampling_params(req, max_tokens, req.logprobs, prompt_logprobs=echo_logprobs,
                                          structured_outputs=None if constraint is None else constraint[0])
            prepared.append((text, ids, params))
        request_id = random_id("cmpl")
        streams = self.start_many(request_id, prepared)
        return _Job(request_id, prepared, streams)

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.engine.tokenizer.decode(ids)

    async def complete(self, req: CompletionRequest, job: _Job) -> CompletionResponse:
        request_id, prepared = job.request_id, job.prepared
        finals: dict[int, RequestOutput] = {}
        async for i, out in self.iterate_many(job.streams):
            if out.finished:
                finals[i] = out
        choices = []
        usage = UsageInfo()
        for i, (text, ids, _params) in enumerate(prepared):
            out = finals[i]
            usage.prompt_tokens += len(ids)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                body, logprobs = c.text, None
                if req.logprobs is not None:
                    logprobs = _Offsets()
                    if req.echo:
                        logprobs.add(self, ids, out.prompt_logprobs or [None] * len(ids))
                    logprobs.add(self, c.token_ids, (c.logprobs or [])[:len(c.token_ids)])
                    logprobs = logprobs.result
                if req.echo:
                    body = self._echo_text(text, ids) + body
                choices.append(CompletionResponseChoice(
                    index=i * req.n + c.index, text=body, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage)

    async def stream(self, req: CompletionRequest, job: _Job) -> AsyncIterator[str]:
        request_id, prepared = job.request_id, job.prepared
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n = req.n
        streams = [ChoiceStream(holdback_for(p)) for _, _, p in prepared for _ in range(n)]
        offsets = [_Offsets() for _ in streams]
        echoed = [not req.echo] * len(streams)
        completion_tokens = 0

        def chunk(choice: dict) -> str:
            body = {"id": request_id, "object": "text_completion", "created": created,
                    "model": self.model_name, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            async for i, out in self.iterate_many(job.streams, finish_aborted=True):
                text, ids, _ = prepared[i]
                for c in out.outputs:
                    k = i * n + c.index
                    delta = streams[k].next(c)
                    if delta is None:
                        continue
                    body = delta.text
                    logprobs = None
                    if req.logprobs is not None:
                        offsets[k].reset()
                        if not echoed[k] and req.echo:
                            offsets[k].add(self, ids, out.prompt_logprobs or [None] * len(ids))
                        offsets[k].add(self, delta.token_ids, delta.logprobs or [])
                        logprobs = offsets[k].result.model_dump()
                    if not echoed[k]:
                        body = self._echo_text(text, ids) + body
                        echoed[k] = True
                    if delta.finish_reason is not None:
                        completion_tokens += len(c.token_ids)
                    yield chunk({"index": k, "text": body, "logprobs": logprobs,
                                 "finish_reason": delta.finish_reason,
                                 "stop_reason": delta.stop_reason})
            if include_usage:
                prompt_tokens = sum(len(ids) for _, ids, _ in prepared)
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                  total_tokens=prompt_tokens + completion_tokens)
                body = {"id": request_id, "object": "text_completion", "created": created,
                        "model": self.model_name, "choices": [], "usage": usage.model_dump()}
                yield f"data: {json.dumps(body)}\n\n"
        except OpenAIError as e:
            yield sse_error_event(e)
        yield "data: [DONE]\n\n"


class _Offsets:
    """Builds legacy logprobs; `text_offset` keeps counting across streamed chunks."""

    def __init__(self):
        self.offset = 0
        self.result = CompletionLogProbs()

    def reset(self) -> None:
        self.result = CompletionLogProbs()

    def add(self, serving: OpenAIServing, token_ids: list[int], logprobs: list) -> None:
        r = self.result
        for tid, lp in zip(token_ids, logprobs):
            entry = lp.get(tid) if lp is not None else None
            token = entry.decoded_token if entry is not None and entry.decoded_token is not None \
                else serving.engine.tokenizer.decode([tid])
            r.tokens.append(token)
            r.token_logprobs.append(None if entry is None else clamp_logprob(entry.logprob))
            r.top_logprobs.append(None if lp is None else {
                (v.decoded_token if v.decoded_token is not None else str(t)): clamp_logprob(v.logprob)
                for t, v in lp.items()})
            r.text_offset.append(self.offset)
            self.offset += len(token)
