"""What completions and chat share: admission, prompt checks, sampling params, and the stream of
engine outputs turned into per-choice deltas.

Every check that can fail on user input happens here, before the request reaches the engine,
and raises an OpenAIError with the offending `param`; engine-side failures are mapped to their
status (queue full 429, loading/draining 503, engine dead 500).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from compilelm.entrypoints.openai.errors import OpenAIError, bad_request, internal_error, unavailable
from compilelm.entrypoints.openai.logit_bias import LogitBiasProcessor, parse_logit_bias
from compilelm.outputs import CompletionOutput, RequestOutput
from compilelm.runtime.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)
from compilelm.sampling_params import SamplingParams

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf


@dataclass
class ServerState:
    async_engine: AsyncLLMEngine
    served_model_names: list[str]
    metrics: object | None = None  # ServerMetrics
    draining: bool = False
    request_logger: object | None = None  # RequestLogger (--enable-log-requests)
    tool_call_parser: str | None = None  # with --enable-auto-tool-choice: tool_choice "auto" parses calls
    reasoning_parser: str | None = None  # --reasoning-parser: <think> text -> reasoning_content


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def clamp_logprob(x: float) -> float:
    return x if math.isfinite(x) else _LOGPROB_FLOOR


class OpenAIServing:
    def __init__(self, state: ServerState):
        self.state = state

    @property
    def engine(self):
        engine = self.state.async_engine.engine
        if engine is None:
            raise unavailable("the model is still loading", retry_after=5)
        return engine

    @property
    def model_name(self) -> str:
        return self.state.served_model_names[0]

    # -- checks --------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.state.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", param="model",
                              code="model_not_found")

    def admit(self, num_seqs: int) -> None:
        """Refuse early (before tokenizing) when the server cannot take the request: all its
        sequences (prompts x n) are admitted or refused together, here once; its engine
        requests are then started (`start`) without an await in between, so nothing else is
        admitted meanwhile. A request larger than max_num_seqs + max_queue_len is admitted
        when nothing else is in flight (429 until then)."""
        if num_seqs > _max_seqs():
            raise bad_request(f"this request asks for {num_seqs} sequences (prompts x n); the "
                              f"limit is {_max_seqs()}", param="n")
        if self.state.draining:
            self._reject("draining")
            raise unavailable("the server is shutting down", retry_after=5)
        try:
            self.state.async_engine.check_admission(num_seqs)
        except BaseException as e:
            raise self.map_error(e) from e

    def _reject(self, reason: str) -> None:
        if self.state.metrics is not None:
            self.state.metrics.count_rejection(reason)

    def check_prompt(self, token_ids: list[int], max_tokens: int | None, param: str = "prompt",
                     ) -> int:
        """Empty / out-of-vocabulary / too long -> 400. Returns max_tokens resolved against the
        context (None: everything that fits)."""
        if not token_ids:
            raise bad_request("the prompt must not be empty", param=param)
        vocab = self.engine.model_config.vocab_size
        for t in token_ids:
            if not 0 <= t < vocab:
                raise bad_request(f"token id {t} is out of vocabulary (size {vocab})", param=param)
        max_len = self.engine.config.max_model_len
        n_prompt = len(token_ids)
        if n_prompt + (max_tokens or 1) > max_len:
            asked = f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} in the " \
                    f"completion)" if max_tokens else f"{n_prompt} tokens in the prompt"
            raise bad_request(f"This model's maximum context length is {max_len} tokens. However, "
                              f"you requested {asked}. Please reduce the length of the prompt or "
                              f"completion.", param=param if n_prompt >= max_len else "max_tokens",
                              code="context_length_exceeded")
        return max_tokens if max_tokens is not None else max_len - n_prompt

    def sampling_params(self, req, max_tokens: int, logprobs: int | None, **extra) -> SamplingParams:
        """The request's fields; those it leaves unset come from the model's generation config
        (--generation-config), whose max_new_tokens also caps max_tokens (as in vLLM)."""
        defaults = self.engine.default_sampling_params()
        if defaults.get("max_tokens") is not None:
            max_tokens = min(max_tokens, defaults["max_tokens"])
        kw = dict(n=req.n, max_tokens=max_tokens, logprobs=logprobs, seed=req.seed,
                  stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                  min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
                  spaces_between_special_tokens=req.spaces_between_special_tokens,
                  include_stop_str_in_output=req.include_stop_str_in_output)
        kw.update(extra)  # the endpoint's own (structured_outputs, prompt_logprobs, ...) win
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(req, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                kw[name] = value
        if req.logit_bias:
            try:
                bias = parse_logit_bias(req.logit_bias, self.engine.model_config.vocab_size)
            except ValueError as e:
                raise bad_request(str(e), param="logit_bias") from e
            kw["logits_processors"] = [LogitBiasProcessor(bias), *kw.get("logits_processors", [])]
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad_request(str(e), param=str(e).split()[0]) from e

    # -- running -------------------------------------------------------------------------------

    def map_error(self, e: BaseException) -> OpenAIError:
        if isinstance(e, OpenAIError):
            return e
        if isinstance(e, QueueFullError):
            self._reject("queue_full")
            return unavailable(str(e), retry_after=1, status=429, code="queue_full")
        if isinstance(e, EngineNotReadyError):
            self._reject("loading")
            return unavailable("the model is still loading", retry_after=5)
        if isinstance(e, RequestAbortedError):
            return unavailable(str(e), retry_after=5)
        if isinstance(e, EngineDeadError):
            self._reject("engine_dead")
            return internal_error(f"{e}; the server must be restarted")
        if isinstance(e, ValueError):
            return bad_request(str(e))
        return internal_error(f"internal server error: {type(e).__name__}")

    def start(self, request_id: str, token_ids: list[int], params: SamplingParams,
              prompt: str | None = None) -> RequestStream:
        """Enqueue one engine request of a request that `admit` took (a dead engine's 500 is
        raised here, before any response bytes are sent)."""
        if self.state.request_logger is not None:
            self.state.request_logger.log_inputs(request_id, prompt, token_ids, params)
        try:
            return self.state.async_engine.generate(request_id, token_ids, params, admitted=True)
        except Exception as e:  # noqa: BLE001 - mapped to a status, never a crash
            raise self.map_error(e) from e

    async def iterate(self, stream: RequestStream, finish_aborted: bool = False,
                      ) -> AsyncIterator[RequestOutput]:
        """The stream's outputs with failures mapped to OpenAIError; closing aborts.

        A request the server aborts (the shutdown timeout ran out) is a 503 with Retry-After
        while no response byte has gone out: the client retries elsewhere and gets a whole
        answer. A stream has already sent its 200 and part of the text: with `finish_aborted`
        it ends as vLLM ends it, each unfinished choice with `finish_reason: "abort"` (what
        clients count), then usage and [DONE], no error event."""
        last = None
        try:
            async for out in stream:
                last = out
                yield out
        except RequestAbortedError as e:
            if not finish_aborted:
                raise self.map_error(e) from e
            yield _aborted(stream, last)
        except Exception as e:  # noqa: BLE001 - mapped to a status, never a crash
            raise self.map_error(e) from e
        finally:
            stream.close()

    def start_many(self, request_id: str, prompts: list[tuple[str | None, list[int], SamplingParams]],
                   ) -> list[RequestStream]:
        streams = []
        try:
            for i, (text, ids, params) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.start(rid, ids, params, text))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    async def iterate_many(self, streams: list[RequestStream], finish_aborted: bool = False,
                           ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Several engine requests at once, outputs interleaved as they come."""
        if len(streams) == 1:
            async for out in self.iterate(streams[0], finish_aborted):
                yield 0, out
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream):
            try:
                async for out in self.iterate(stream, finish_aborted):
                    merged.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                merged.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            done = 0
            while done < len(tasks):
                i, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                done += item.finished
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.close()
            await asyncio.gather(*tasks, return_exceptions=True)


def _aborted(stream: RequestStream, last: RequestOutput | None) -> RequestOutput:
    """The final output of an aborted request: what was generated, unfinished choices ending
    with finish_reason "abort"."""
    done = {c.index: c for c in last.outputs} if last is not None else {}
    outputs = [dataclasses.replace(done[i], finish_reason=done[i].finish_reason or "abort")
               if i in done else CompletionOutput(i, "", [], finish_reason="abort")
               for i in range(stream.num_seqs)]
    return RequestOutput(stream.request_id, None,
                         last.prompt_token_ids if last is not None else [],
                         last.prompt_logprobs if last is not None else None, outputs,
                         finished=True)


def _max_seqs() -> int:
    from compilelm.entrypoints.openai.protocol import MAX_SEQS_PER_REQUEST
    return MAX_SEQS_PER_REQUEST


@dataclass
class ChoiceDelta:
    text: str
    token_ids: list[int]
    logprobs: list | None  # per new token: dict[int, Logprob]
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class ChoiceStream:
    """What one choice has streamed so far. Text that may still turn out to be the start of a
    stop string is held back (the engine cuts a matched stop string from the text)."""

    holdback: int = 0
    text_sent: int = 0
    tokens_sent: int = 0
    done: bool = False
    pending: list = field(default_factory=list)

    def next(self, out: CompletionOutput) -> ChoiceDelta | None:
        if self.done:
            return None
        finished = out.finish_reason is not None
        end = len(out.text) if finished else max(self.text_sent, len(out.text) - self.holdback)
        n_tokens = len(out.token_ids)
        if end == self.text_sent and not finished:
            return None
        text = out.text[self.text_sent:end]
        token_ids = out.token_ids[self.tokens_sent:n_tokens]
        logprobs = None if out.logprobs is None else out.logprobs[self.tokens_sent:n_tokens]
        self.text_sent, self.tokens_sent, self.done = end, n_tokens, finished
        return ChoiceDelta(text, token_ids, logprobs, out.finish_reason if finished else None,
                           out.stop_reason if finished else None)


def holdback_for(params: SamplingParams) -> int:
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1
