"""`compilelm serve [MODEL]`: the OpenAI-compatible HTTP server (flags in vLLM's spelling)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from compilelm.entrypoints.engine_args import ArgError, add_engine_args, engine_config_from_args
from compilelm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from compilelm.entrypoints.openai.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("compilelm")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) in the API (default: the model's name)")
    g.add_argument("--api-key", action="append", default=None,
                   help="require `Authorization: Bearer <key>` on every route but /health and "
                        "/metrics (repeat for several keys)")
    g.add_argument("--require-api-key-for-metrics", action="store_true",
                   help="with --api-key, /metrics needs the key too (default: open, as in vLLM)")
    g.add_argument("--public-metrics", action="store_true",
                   help=argparse.SUPPRESS)  # the default now; still accepted
    g.add_argument("--max-queue-len", type=int, default=1024,
                   help="sequences that may wait beyond --max-num-seqs; more get 429")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM (0: abort)")
    g.add_argument("--max-request-body-bytes", type=int, default=8 * 2**20,
                   help="larger request bodies get 413")
    g.add_argument("--uvicorn-log-level", "--log-level", dest="log_level", default="info",
                   choices=["debug", "info", "warning", "error", "critical", "trace"], help="uvicorn's log level")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per HTTP request (default: on, as in vLLM)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt and sampling parameters as it arrives")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM command lines (requests are not logged unless --enable-log-requests)")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: at most this many prompt characters / ids per line")
    tools = p.add_argument_group("tool calling and reasoning (vLLM's flags)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto" (the default when a request has tools): the model decides, '
                            "--tool-call-parser reads its calls")
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help=f"how the model writes tool calls: {', '.join(sorted(TOOL_PARSERS))} (Qwen2.5/Qwen3: "
                            "hermes; Qwen3-Coder: qwen3_coder; Llama 3.1+: llama3_json)")
    tools.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help=f"split <think>...</think> into reasoning_content: {', '.join(sorted(REASONING_PARSERS))}")
    cors = p.add_argument_group("CORS (as vLLM: every origin allowed by default)")
    cors.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=["*"], metavar="JSON")
    cors.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"], metavar="JSON")
    cors.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"], metavar="JSON")
    cors.add_argument("--allowed-credentials", action="store_true", help="allow credentials (cookies, auth)")
    p.set_defaults(run=run)


def _json_list(flag: str):
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"{flag}: not a JSON list: {text!r}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag}: must be a JSON list of strings, got {text!r}")
        return value
    return parse


def _check_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ArgError(f"--port: must be in [0, 65535], got {args.port}")
    if args.max_queue_len < 0:
        raise ArgError(f"--max-queue-len: must be >= 0, got {args.max_queue_len}")
    if args.shutdown_timeout < 0:
        raise ArgError(f"--shutdown-timeout: must be >= 0, got {args.shutdown_timeout}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ArgError(f"--max-log-len: must be >= 0, got {args.max_log_len}")
    if args.max_request_body_bytes < 1024:
        raise ArgError(f"--max-request-body-bytes: must be >= 1024, got {args.max_request_body_bytes}")
    for key in args.api_key or []:
        if not key:
            raise ArgError("--api-key: must not be empty")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise ArgError(f"--tool-call-parser: unknown parser {args.tool_call_parser!r} (choose from "
                       f"{', '.join(sorted(TOOL_PARSERS))})")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ArgError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ArgError(f"--reasoning-parser: unknown parser {args.reasoning_parser!r} (choose from "
                       f"{', '.join(sorted(REASONING_PARSERS))})")


def _engine(config):
    """The engine, and its grammar backend's tokenizer (0.3 s for a 49k vocabulary, holding the GIL)
    and mask kernel: built now, so that the first structured request does not stall every stream."""
    from compilelm.runtime.engine import LLMEngine
    from compilelm.runtime.structured_output import GrammarError

    engine = LLMEngine(config)
    try:
        engine.structured_output.ll_tokenizer()
        engine.executor.model_runner.warm_up_masks()  # the mask kernel's compile, too
    except GrammarError as e:  # e.g. no tokenizer.json: structured requests get a 400 saying so
        logger.info("structured outputs unavailable: %s", e)
    return engine


def run(args: argparse.Namespace) -> int:
    from compilelm.entrypoints.openai.api_server import build_app, serve_http
    from compilelm.entrypoints.openai.metrics import ServerMetrics
    from compilelm.entrypoints.openai.serving_engine import ServerState
    from compilelm.models.loader import resolve_model
    from compilelm.runtime.async_engine import AsyncLLMEngine

    _check_server_args(args)
    config = dataclasses.replace(engine_config_from_args(args, usage_context="openai_api_server"),
                                 reasoning_parser=args.reasoning_parser)  # the engine gates grammars by it
    # a missing model fails now, before the port is bound (and a repo id is downloaded once, here)
    source = resolve_model(config.model, config.revision, config.download_dir)
    from compilelm.ops.device_check import check_cuda_device
    check_cuda_device(config.torch_device())  # a GPU the kernels were not built for: now, not at a request
    names = args.served_model_name or [source.name]
    async_engine = AsyncLLMEngine(lambda: _engine(config), max_queue_len=args.max_queue_len)
    state = ServerState(async_engine, names, reasoning_parser=args.reasoning_parser,
                        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        logger.warning("--tool-call-parser %s without --enable-auto-tool-choice: tool_choice \"auto\" is refused "
                       "(required and named choices do not need a parser)", args.tool_call_parser)
    if args.enable_log_requests:
        from compilelm.entrypoints.openai.request_logger import RequestLogger
        state.request_logger = RequestLogger(args.max_log_len)
    state.metrics = async_engine.metrics = ServerMetrics(names[0], lambda: async_engine.stats)
    logger.info("compilelm serve: model=%s served as %s, max_model_len=%s, api_key=%s",
                source.name, names, config.max_model_len or "auto",
                "set" if args.api_key else "none")
    cors = {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
            "allow_headers": args.allowed_headers, "allow_credentials": args.allowed_credentials}
    app = build_app(state, api_keys=args.api_key, guard_metrics=args.require_api_key_for_metrics,
                    max_body_bytes=args.max_request_body_bytes, cors=cors)
    return serve_http(app, state, args.host, args.port, args.shutdown_timeout, args.log_level,
                      access_log=not args.disable_uvicorn_access_log, log_stats=not args.disable_log_stats)
