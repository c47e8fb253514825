"""`compilelm` command line: generate, compile, serve, bench, passes."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = ["generate", "compile", "serve", "bench", "passes"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compilelm", description="compilelm: compiled LLM serving")
    parser.add_argument("--version", action="version", version=f"compilelm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"compilelm.entrypoints.cli_{name}")
        except ModuleNotFoundError as e:
            if e.name != f"compilelm.entrypoints.cli_{name}":
                raise
            continue
        mod.add_parser(sub)
    return parser


def _version() -> str:
    from compilelm import __version__
    return __version__


def main(argv: list[str] | None = None) -> int:
    from compilelm.entrypoints.argv import ConfigFileError, expand_argv

    parser = build_parser()
    try:
        argv = expand_argv(sys.argv[1:] if argv is None else list(argv), parser)
    except ConfigFileError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s] %(message)s",
                        datefmt="%H:%M:%S")
    from compilelm.entrypoints.engine_args import ArgError
    from compilelm.ops.device_check import UnsupportedDeviceError
    try:
        return args.run(args) or 0
    except (ArgError, FileNotFoundError, ValueError, UnsupportedDeviceError) as e:
        print(f"compilelm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
