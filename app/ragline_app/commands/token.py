"""`ragline token`: a client token signed with the local key, for a tenant and scopes."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    token = sub.add_parser(
        "token", help="mint a client token signed with RAGLINE_AUTH_JWT_KEY (development)"
    )
    token.add_argument("--tenant", required=True)
    token.add_argument("--principal", default="")
    token.add_argument(
        "--scopes",
        default="",
        help="comma-separated scopes: visibility scopes, and ragline:write to write documents",
    )
    token.add_argument("--ttl", type=float, default=3600.0, help="lifetime in seconds")
    token.add_argument(
        "--operator", action="store_true", help="also sees figures that count every tenant"
    )
    token.set_defaults(func=cmd_token)


def cmd_token(args: argparse.Namespace) -> int:
    from ragline.auth import AuthConfig, mint_token

    config = AuthConfig()
    if not config.jwt_key:
        print(
            "ragline token: set RAGLINE_AUTH_JWT_KEY (the HMAC key the services verify with); "
            "tokens for a public-key setup come from your identity provider",
            file=sys.stderr,
        )
        return 2
    print(
        mint_token(
            config.jwt_key,
            args.tenant,
            principal=args.principal,
            scopes=[s for s in args.scopes.split(",") if s],
            ttl_s=args.ttl,
            audience=config.jwt_audience,
            operator=args.operator,
        )
    )
    return 0
