"""`ragline etcd-setup`: etcd's auth turned on with the budget service's user (the chart's
setup Job)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    etcd_setup = sub.add_parser(
        "etcd-setup",
        help="turn etcd auth on with the budget service's user (the chart's setup Job)",
        description="Signs in to etcd at RAGLINE_BUDGET_ETCD_ENDPOINTS (TLS: the budget's "
        "RAGLINE_BUDGET_ETCD_CA_FILE / _CERT_FILE / _KEY_FILE), makes the root user "
        "(password RAGLINE_ETCD_ROOT_PASSWORD) and the user RAGLINE_BUDGET_ETCD_USERNAME "
        "(password RAGLINE_BUDGET_ETCD_PASSWORD) whose role reads and writes "
        "RAGLINE_BUDGET_KEY_PREFIX only, and turns auth on. Idempotent.",
    )
    etcd_setup.add_argument(
        "--wait", type=float, default=300.0, help="seconds to keep trying while etcd starts"
    )
    etcd_setup.set_defaults(func=cmd_etcd_setup)


def cmd_etcd_setup(args: argparse.Namespace) -> int:
    import time

    from ragline_app.etcd_server import LedgerCredentials, provision_ledger_user
    from ragline_services.budget.service import BudgetConfig

    config = BudgetConfig()
    root_password = os.environ.get("RAGLINE_ETCD_ROOT_PASSWORD", "")
    if not (root_password and config.etcd_username and config.etcd_password):
        print(
            "ragline etcd-setup: set RAGLINE_ETCD_ROOT_PASSWORD, RAGLINE_BUDGET_ETCD_USERNAME "
            "and RAGLINE_BUDGET_ETCD_PASSWORD",
            file=sys.stderr,
        )
        return 2
    credentials = LedgerCredentials(root_password, config.etcd_username, config.etcd_password)
    tls_files = None
    if config.etcd_ca_file and config.etcd_cert_file and config.etcd_key_file:
        tls_files = (config.etcd_ca_file, config.etcd_cert_file, config.etcd_key_file)
    deadline = time.monotonic() + args.wait
    while True:
        try:
            asyncio.run(
                provision_ledger_user(
                    config.etcd_endpoints, credentials, config.key_prefix, tls_files=tls_files
                )
            )
        except Exception as error:  # etcd still starting, or refusing: said, then retried
            if time.monotonic() > deadline:
                print(f"ragline etcd-setup: {error}", file=sys.stderr)
                return 1
            print(f"ragline etcd-setup: not yet ({error}); retrying", file=sys.stderr, flush=True)
            time.sleep(3)
            continue
        print(
            f"ragline etcd-setup: auth on; user {config.etcd_username!r} reads and writes "
            f"{config.key_prefix}/ only"
        )
        return 0
