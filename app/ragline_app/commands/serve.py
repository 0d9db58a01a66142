"""`ragline serve SERVICE`: one service in the foreground (the image's entrypoint runs it)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from ragline_app.commands.common import service_names


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run one service in the foreground")
    serve.add_argument("service", choices=service_names())
    serve.add_argument(
        "--host", help="listen address (default RAGLINE_<SERVICE>_HOST or 127.0.0.1)"
    )
    serve.add_argument("--port", type=int, help="listen port (default RAGLINE_<SERVICE>_PORT)")
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from ragline.config import ConfigError
    from ragline.errors import StartRefused
    from ragline.server import serve
    from ragline_app.stack import local_addresses
    from ragline_services.registry import default_port, load_spec

    prefix = f"RAGLINE_{args.service.upper()}_"
    if args.port is not None:
        os.environ[f"{prefix}PORT"] = str(args.port)
    os.environ.setdefault(f"{prefix}PORT", str(default_port(args.service)))
    if args.host is not None:
        os.environ[f"{prefix}HOST"] = args.host
    # Where the other services listen, unless configured: the local loopback layout.
    os.environ.update(local_addresses())
    if args.service == "gateway":
        from ragline_services.gateway.service import serve_gateway

        try:
            asyncio.run(serve_gateway())
        except (OSError, ConfigError) as error:
            print(f"ragline serve gateway: {error}", file=sys.stderr)
            return 1
        return 0
    spec = load_spec(args.service)
    try:
        asyncio.run(serve(spec))
    except (OSError, StartRefused, ConfigError) as error:
        print(f"ragline serve {args.service}: {error}", file=sys.stderr)
        return 1
    return 0
