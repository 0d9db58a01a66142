"""`ragline openapi`: the HTTP gateway's OpenAPI file (docs/openapi.json is its output)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ragline.config import CommonConfig


def register(sub: argparse._SubParsersAction) -> None:
    openapi = sub.add_parser("openapi", help="print the HTTP gateway's OpenAPI file")
    openapi.add_argument("--out", help="write it to this file instead")
    openapi.set_defaults(func=cmd_openapi)


def cmd_openapi(args: argparse.Namespace) -> int:
    """The gateway's OpenAPI file (docs/openapi.json is this output)."""
    from ragline_app.stack import local_addresses
    from ragline_services.gateway.app import Backends, build_app
    from ragline_services.gateway.config import GatewayConfig

    os.environ.update(local_addresses())
    common = CommonConfig()
    app = build_app(GatewayConfig(), common, Backends(common))
    text = json.dumps(app.openapi(), indent=2, ensure_ascii=False) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
