"""The FastAPI app: routes, health, metrics; and `serve_http`, which runs it under uvicorn.

Life of the process: the socket is bound and /health answers 503 while the engine thread loads
the model; once ready, /health is 200. SIGTERM starts a drain: /health and new requests get 503,
in-flight requests run to the end for up to `shutdown_timeout` seconds, then whatever is left is
aborted and the process exits 0 (at once while the model is still loading). When the engine
dies (an exception in a step), every in-flight request gets a 500 or an error event, /health
and new requests fail at once (503, 500), and once the in-flight requests have had their error
(or after `_DEAD_EXIT_S`) the process exits 1, so that a supervisor restarts it (as vLLM does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from compilelm.entrypoints.openai.errors import OpenAIError, install_error_handlers, unavailable
from compilelm.entrypoints.openai.ignored_fields import report_ignored
from compilelm.entrypoints.openai.metrics import CONTENT_TYPE
from compilelm.entrypoints.openai.middleware import AuthMiddleware, BodyLimitMiddleware
from compilelm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    VersionResponse,
)
from compilelm.entrypoints.openai.serving_chat import OpenAIServingChat
from compilelm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from compilelm.entrypoints.openai.serving_engine import ServerState
from compilelm.entrypoints.openai.stats_logger import StatsLogger
from compilelm.entrypoints.openai.tokenizer_info import tokenizer_info

logger = logging.getLogger("compilelm")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)}
_DEAD_EXIT_S = 5.0  # longest wait, once the engine died, for in-flight requests to get their error


def _json_or_sse(model) -> dict:
    return {200: {"model": model, "content": {"text/event-stream": {}}}, **_ERRORS}


def build_app(state: ServerState, api_keys: list[str] | None = None, guard_metrics: bool = False,
              max_body_bytes: int = 8 * 2**20, cors: dict | None = None) -> FastAPI:
    """With `api_keys`, every route needs one but /health and /metrics (as in vLLM, whose
    Prometheus scrapes carry no key); `guard_metrics` puts /metrics behind the key too. `cors`:
    CORSMiddleware's allow_origins / allow_methods / allow_headers / allow_credentials (default,
    as vLLM's: every origin, method and header, no credentials); it wraps everything, so a
    browser's preflight needs no key."""
    from compilelm import __version__

    app = FastAPI(title="compilelm OpenAI-compatible API", version=__version__)
    app.state.server = state
    install_error_handlers(app)
    completion = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)
    engine = state.async_engine

    @app.get("/health", response_class=Response, responses={503: {"model": ErrorResponse}})
    async def health():
        if engine.errored:
            return unavailable("the engine is dead", retry_after=60).response()
        if state.draining:
            return unavailable("the server is shutting down", retry_after=5).response()
        if not engine.is_ready:
            return unavailable("the model is loading", retry_after=5).response()
        return Response(status_code=200)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models():
        max_len = engine.engine.config.max_model_len if engine.engine is not None else None
        root = engine.engine.source.name if engine.engine is not None else None
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=max_len)
                               for name in state.served_model_names])

    @app.get("/version", response_model=VersionResponse, responses=_ERRORS)
    async def version():
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse, responses=_ERRORS)
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", responses=_json_or_sse(CompletionResponse))
    async def create_completion(body: CompletionRequest, raw: Request):
        headers = report_ignored(body)
        job = await completion.prepare(body)
        if body.stream:
            return _sse(completion.stream(body, job), headers)
        resp = await _until_disconnect(raw, completion.complete(body, job))
        return resp if isinstance(resp, Response) else JSONResponse(resp.model_dump(), headers=headers)

    @app.post("/v1/chat/completions", responses=_json_or_sse(ChatCompletionResponse))
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request):
        headers = report_ignored(body)
        job = await chat.prepare(body)
        if body.stream:
            return _sse(chat.stream(body, job), headers)
        resp = await _until_disconnect(raw, chat.complete(body, job))
        return resp if isinstance(resp, Response) else JSONResponse(resp.model_dump(), headers=headers)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest):
        headers = report_ignored(body)
        completion.check_model(body.model)
        tok = completion.engine.tokenizer
        if isinstance(body, TokenizeChatRequest):
            ids = chat.render(body.messages, body.add_generation_prompt, body.continue_final_message,
                              body.chat_template_kwargs, body.tools)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=completion.engine.config.max_model_len,
                                             tokens=ids, token_strs=strs).model_dump(), headers=headers)

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses=_ERRORS)
    async def get_tokenizer_info():
        return JSONResponse(tokenizer_info(completion.engine.tokenizer))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest):
        completion.check_model(body.model)
        vocab = completion.engine.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is out of vocabulary (size {vocab})",
                              param="tokens")
        return DetokenizeResponse(prompt=completion.engine.tokenizer.decode(body.tokens))

    wrapped = BodyLimitMiddleware(app, max_body_bytes)
    if api_keys:
        public = frozenset({"/health"} | (set() if guard_metrics else {"/metrics"}))
        wrapped = AuthMiddleware(wrapped, api_keys, public)
    cors = {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"], "allow_credentials": False,
            **(cors or {})}
    return CORSMiddleware(wrapped, **cors)


def _sse(chunks, headers: dict | None = None) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


async def _until_disconnect(raw: Request, coro):
    """Run a non-streaming handler, cancelling it (and so aborting its engine requests) if the
    client goes away first."""
    task = asyncio.ensure_future(coro)

    async def disconnected():
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # let the cancellation run the handler's cleanup (the engine abort)
    return Response(status_code=499)  # nobody is listening any more


class _Server(uvicorn.Server):
    """uvicorn with a drain on SIGTERM/SIGINT: stop admitting, let in-flight work finish for up to
    `shutdown_timeout` seconds, abort the rest, exit. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.drain_deadline: float | None = None
        self.dead_deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_deadline is not None:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        logger.info("received %s: draining for up to %.0f s (in-flight sequences: %d)",
                    signal.Signals(sig).name, self.shutdown_timeout,
                    self.state.async_engine.num_seqs_in_flight)
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        engine = self.state.async_engine
        if engine.dead_error is not None:
            if self.dead_deadline is None:
                logger.error("the engine is dead: exiting with status 1 once the %d in-flight "
                             "sequences have their error", engine.num_seqs_in_flight)
                self.dead_deadline = time.monotonic() + _DEAD_EXIT_S
            return engine.num_seqs_in_flight == 0 or time.monotonic() >= self.dead_deadline
        if self.drain_deadline is None:
            if engine.load_error is not None:
                return True  # the model never loaded: stop serving 503s forever
            return False
        if engine.num_seqs_in_flight == 0:
            return True
        if time.monotonic() >= self.drain_deadline:
            logger.warning("shutdown timeout: aborting %d in-flight sequences",
                           engine.num_seqs_in_flight)
            engine.abort_all()
            self.drain_deadline = float("inf")  # abort once, then wait for the streams to end
            asyncio.get_running_loop().call_later(2.0, setattr, self, "should_exit", True)
        return False


def serve_http(app, state: ServerState, host: str, port: int, shutdown_timeout: float,
               log_level: str = "info", access_log: bool = True, log_stats: bool = True) -> int:
    """Serve until drained or the engine dies; returns the exit status (1: the engine died).
    Raises the engine's load error if the model failed to load. `access_log`: uvicorn's line per
    HTTP request; `log_stats`: the periodic stats line (stats_logger.py)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=5, timeout_keep_alive=5,
                            h11_max_incomplete_event_size=64 * 1024)  # bounds header memory
    server = _Server(config, state, shutdown_timeout)
    engine = state.async_engine
    url = f"http://{host}:{port}"

    async def announce_ready():
        while not engine.wait_ready(0):
            await asyncio.sleep(0.1)
        if engine.engine is not None:
            logger.info("compilelm API server ready on %s (model %s)", url,
                        ", ".join(state.served_model_names))

    async def main():
        engine.start()
        logger.info("Starting compilelm API server on %s (loading the model; /health is 503 "
                    "until ready)", url)
        ready = asyncio.ensure_future(announce_ready())
        stats = asyncio.ensure_future(StatsLogger(lambda: engine.stats).run()) if log_stats else None
        try:
            await server.serve()
        finally:
            ready.cancel()
            if stats is not None:
                stats.cancel()

    try:
        asyncio.run(main())
    finally:
        stopped = engine.shutdown()
    if engine.load_error is not None:
        raise engine.load_error
    if not stopped:
        # SIGTERM while the engine thread still loads the model: nothing is in flight, and the
        # interpreter's exit under a thread inside torch aborts the process ("terminate called
        # without an active exception", exit 134), so leave at once
        logger.info("exiting while the model was still loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 1 if engine.dead_error is not None else 0
