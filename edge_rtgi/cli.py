"""The ``edge-rtgi`` command line.

Each group of subcommands lives in its own module with a ``register(subparsers)`` function
that adds parsers and sets ``func`` (called with the parsed args, returns an exit code).
This file only wires them together and turns user errors into one-line messages.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from edge_rtgi import __version__
from edge_rtgi.errors import EdgeRtgiError

# Order is the order in `edge-rtgi --help`.
COMMAND_MODULES = [
    "edge_rtgi.commands.models",
    "edge_rtgi.commands.llm",
    "edge_rtgi.commands.speech",
    "edge_rtgi.commands.quantize",
    "edge_rtgi.commands.serve",
    "edge_rtgi.commands.bench",
    "edge_rtgi.commands.bench_llm",  # adds `bench llm` to the bench group
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-rtgi", description="On-device real-time voice runtime.")
    parser.add_argument("--version", action="version", version=f"edge-rtgi {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except EdgeRtgiError as exc:
        print(f"edge-rtgi: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
