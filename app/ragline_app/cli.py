"""The `ragline` command: serve one service, run the whole stack, ask a question."""

from __future__ import annotations

import argparse
import sys

from ragline.config import CommonConfig
from ragline_app.commands import (
    ask,
    data,
    doctor,
    etcd_setup,
    health,
    ingest,
    models,
    openapi,
    serve,
    token,
    top,
    up,
)

# In the order `ragline --help` lists them.
COMMANDS = (serve, openapi, up, ask, ingest, token, models, top, data, doctor, health, etcd_setup)


def build_parser() -> argparse.ArgumentParser:
    from ragline import __version__

    parser = argparse.ArgumentParser(prog="ragline", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ragline {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in ("serve", "up", "etcd-setup"):
        from ragline_app.stack import use_stack_tls

        use_stack_tls(CommonConfig().data_dir)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
