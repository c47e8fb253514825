"""`compilelm serve [MODEL]`: the OpenAI-compatible HTTP server (flags in vLLM's spelling)."""

from __future__ import annotations

import argparse
import logging

from compilelm.entrypoints.engine_args import ArgError, add_engine_args, engine_config_from_args

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
    p.set_defaults(run=run)


def _check_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ArgError(f"--port: must be in [0, 65535], got {args.port}")
    if args.max_queue_len < 0:
        raise ArgError(f"--max-queue-len: must be >= 0, got {args.max_queue_len}")
    if args.shutdown_timeout < 0:
        raise ArgError(f"--shutdown-timeout: must be >= 0, got {args.shutdown_timeout}")
    if args.max_request_body_bytes < 1024:
        raise ArgError(f"--max-request-body-bytes: must be >= 1024, got {args.max_request_body_bytes}")
    for key in args.api_key or []:
        if not key:
            raise ArgError("--api-key: must not be empty")


def run(args: argparse.Namespace) -> int:
    from compilelm.entrypoints.openai.api_server import build_app, serve_http
    from compilelm.entrypoints.openai.metrics import ServerMetrics
    from compilelm.entrypoints.openai.serving_engine import ServerState
    from compilelm.models.loader import resolve_model
    from compilelm.runtime.async_engine import AsyncLLMEngine
    from compilelm.runtime.engine import LLMEngine

    _check_server_args(args)
    config = engine_config_from_args(args)
    # a missing model fails now, before the port is bound (and a repo id is downloaded once, here)
    source = resolve_model(config.model, config.revision, config.download_dir)
    names = args.served_model_name or [source.name]
    async_engine = AsyncLLMEngine(lambda: LLMEngine(config), max_queue_len=args.max_queue_len)
    state = ServerState(async_engine, names)
    state.metrics = async_engine.metrics = ServerMetrics(names[0], lambda: async_engine.stats)
    logger.info("compilelm serve: model=%s served as %s, max_model_len=%s, api_key=%s",
                source.name, names, config.max_model_len or "auto",
                "set" if args.api_key else "none")
    app = build_app(state, api_keys=args.api_key, guard_metrics=args.require_api_key_for_metrics,
                    max_body_bytes=args.max_request_body_bytes)
    return serve_http(app, state, args.host, args.port, args.shutdown_timeout, args.log_level)
