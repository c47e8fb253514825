"""`compilelm bench {latency,throughput,serve}`: vLLM's `vllm bench` (compilelm/entrypoints/bench/)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from compilelm.entrypoints.bench import offline, serve
    p = sub.add_parser("bench", help="benchmark latency, throughput or a running server (as vllm bench)")
    kinds = p.add_subparsers(dest="bench_command", metavar="{latency,throughput,serve}", required=True)
    offline.add_parsers(kinds)
    serve.add_parser(kinds)
