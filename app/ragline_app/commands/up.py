"""`ragline up`: every service on loopback until Ctrl-C, the demo corpus loaded, its health
watched."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ragline.config import CommonConfig
from ragline_app.commands.common import service_names

if TYPE_CHECKING:
    from ragline_app.etcd_server import EtcdServer
    from ragline_app.stack import Stack


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="run every service on loopback until Ctrl-C")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="orchestrator port; the others follow it (default 50100; 0 picks free ports)",
    )
    up.add_argument("--only", help="comma-separated subset of services")
    up.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="serve no /metrics port (default: each service serves one, for `ragline top`)",
    )
    up.add_argument(
        "--no-demo",
        dest="demo",
        action="store_false",
        help="do not load the demo corpus (SQuAD sample) into an empty tenant 'default'",
    )
    up.add_argument(
        "--tls",
        nargs="?",
        const="mtls",
        choices=["tls", "mtls"],
        help="encrypt every call: mtls (the default with --tls) also makes each service and "
        "command present a certificate; a local CA under <data dir>/tls signs them unless "
        "RAGLINE_TLS_* names the operator's files",
    )
    up.add_argument("--log-dir", help="where each service logs (default .ragline/logs)")
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for every service to report SERVING",
    )
    up.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds services get to finish in-flight calls on shutdown",
    )
    up.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace) -> int:
    common = CommonConfig()
    plan = _up_plan(args, common)
    if isinstance(plan, int):
        return plan
    state_path = common.data_dir / "up.json"
    try:
        code = asyncio.run(_up(plan, args, common, state_path))
    finally:
        print("ragline up: stopping...", flush=True)
        codes = plan.stack.stop(grace_s=args.grace)
        state_path.unlink(missing_ok=True)
        unclean = {n: c for n, c in codes.items() if c not in (0, None)}
        if unclean:
            print(f"ragline up: stopped; exit codes {unclean}", flush=True)
        else:
            print("ragline up: all services stopped cleanly", flush=True)
    return code


@dataclass
class _UpPlan:
    """What `ragline up` runs, where, and how its own health checks reach it."""

    names: list[str]
    log_dir: Path
    stack: Stack
    etcd: EtcdServer | None
    client_tls: dict[str, str]


def _up_plan(args: argparse.Namespace, common: CommonConfig) -> _UpPlan | int:
    """The stack to start, or the exit code of a refusal (before anything starts)."""
    from ragline.auth import AuthConfig
    from ragline.config import ConfigError
    from ragline.errors import StartRefused
    from ragline_app.etcd_server import EtcdServer, LedgerCredentials
    from ragline_app.stack import Stack, plan_ports

    try:
        AuthConfig().check_exposure(args.host)
    except StartRefused as error:
        print(f"ragline up: {error}", file=sys.stderr)
        return 2
    names = args.only.split(",") if args.only else service_names()
    unknown = sorted(set(names) - set(service_names()))
    if unknown:
        print(f"ragline up: unknown service(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else common.data_dir / "logs"
    ports = plan_ports(names, args.base_port, args.host)
    # --tls: the local CA (the local etcd's certificates, and the services' where the
    # environment names no files of the operator's)
    certificates = _local_certificates(args, common) if args.tls else None
    try:
        service_tls, client_tls = _stack_tls(args, certificates)
    except ConfigError as error:
        print(f"ragline up: {error}", file=sys.stderr)
        return 2
    etcd, ledger_credentials = None, None
    if "budget" in names and "RAGLINE_BUDGET_ETCD_ENDPOINTS" not in os.environ:
        # The budget ledger needs etcd: run a local one unless an external one is configured.
        # Under --tls it is secured too: TLS with client certificates, and a user for the
        # budget service that reaches the ledger's keys only.
        etcd = EtcdServer(
            common.data_dir / "etcd",
            ports["etcd"],
            ports["etcd-peer"],
            host=args.host,
            log_path=log_dir / "etcd.log",
            certificates=certificates,
        )
        if certificates is not None:
            ledger_credentials = LedgerCredentials.load_or_create(
                common.data_dir / "etcd-credentials.json"
            )
            service_tls = {
                **service_tls,
                **_secured_ledger_environment(certificates, ledger_credentials),
            }
    # this process checks the services' health and loads the demo as a client of theirs
    os.environ.update(client_tls)
    stack = Stack(
        names, ports, log_dir, args.host, etcd=etcd, metrics=args.metrics, tls=service_tls
    )
    stack.client_tls = client_tls
    if etcd is not None and ledger_credentials is not None:
        local_etcd, credentials = etcd, ledger_credentials
        stack.etcd_setup = lambda: _provision_ledger(local_etcd, credentials)
    return _UpPlan(names, log_dir, stack, etcd, client_tls)


async def _up(
    plan: _UpPlan, args: argparse.Namespace, common: CommonConfig, state_path: Path
) -> int:
    """Starts the stack, waits for it, loads the demo, then watches it until told to stop
    or a service dies; the exit code."""
    from ragline_app.stack import StackError

    stack = plan.stack
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        stack.start()
    except (RuntimeError, OSError) as error:
        print(f"ragline up: {error}", file=sys.stderr, flush=True)
        return 1
    if plan.etcd is not None:
        etcd = plan.etcd
        print(f"  etcd          {etcd.endpoint}  (budget ledger, data in {etcd.data_dir})")
    print(f"ragline up: starting {len(plan.names)} services (logs in {plan.log_dir}/)", flush=True)
    print(f"ragline up: {_auth_notice()}", flush=True)
    ready = asyncio.create_task(stack.wait_ready(args.ready_timeout))
    interrupted = asyncio.create_task(stop_requested.wait())
    await asyncio.wait({ready, interrupted}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        print("ragline up: interrupted during start", flush=True)
        return 130
    try:
        ready.result()
    except StackError as error:
        print(f"ragline up: {error}", file=sys.stderr, flush=True)
        return 1
    stack.write_state(state_path)
    width = max(len(n) for n in plan.names)
    for svc in stack.services:
        metrics = f"  metrics {svc.metrics_url}" if svc.metrics_url else ""
        print(f"  {svc.name:<{width}}  {svc.address}  SERVING{metrics}", flush=True)
    print("ragline up: `ragline top` shows them live", flush=True)
    if args.demo and {"retrieval", "embedding"} <= set(plan.names):
        loading = asyncio.create_task(_load_demo(stack, common))
        await asyncio.wait({loading, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            loading.cancel()
            return 130
        if loading.exception() is not None:
            print(
                f"ragline up: the demo corpus did not load: {loading.exception()}",
                file=sys.stderr,
                flush=True,
            )
    _print_ready(stack, plan.client_tls)
    return await _watch(stack, stop_requested)


def _print_ready(stack: Stack, client_tls: dict[str, str]) -> None:
    orchestrator = next((s for s in stack.services if s.name == "orchestrator"), None)
    gateway = next((s for s in stack.services if s.name == "gateway"), None)
    if orchestrator is not None:
        print(
            'ragline up: ready. Try: ragline ask "Which river flows through Warsaw?"   or   '
            f"grpcurl {_grpcurl_transport(client_tls)} {orchestrator.address} list",
            flush=True,
        )
        if gateway is not None:
            scheme = "http" if client_tls.get("RAGLINE_TLS_MODE", "off") == "off" else "https"
            print(
                f"ragline up: the OpenAI-compatible API is {scheme}://{gateway.address}/v1 "
                "(docs/clients.md)",
                flush=True,
            )
    else:
        print("ragline up: ready.", flush=True)
    print("Ctrl-C stops all services.", flush=True)


async def _watch(stack: Stack, stop_requested: asyncio.Event) -> int:
    """Until told to stop (0), or a service dies (1: the others are stopped then)."""
    while not stop_requested.is_set():
        dead = stack.dead()
        if dead:
            svc = dead[0]
            print(
                f"ragline up: {svc.name} exited with code {svc.exit_code}; stopping "
                f"the others. End of {svc.log_path}:\n{svc.log_tail()}",
                file=sys.stderr,
                flush=True,
            )
            return 1
        try:
            await asyncio.wait_for(stop_requested.wait(), timeout=0.5)
        except TimeoutError:
            pass
    return 0


async def _load_demo(stack, common: CommonConfig) -> None:
    from ragline_app.ingest import DEMO_CORPUS, DEMO_TENANT, load_demo

    addresses = {svc.name: svc.address for svc in stack.services}
    print(
        f"ragline up: loading the demo corpus ({DEMO_CORPUS.name}) into tenant "
        f"{DEMO_TENANT!r} if it is empty...",
        flush=True,
    )
    written = await load_demo(
        retrieval_addr=addresses["retrieval"],
        embedding_addr=addresses["embedding"],
        data_dir=common.data_dir,
        rerank_addr=addresses.get("rerank"),
        notice=lambda text: print(f"ragline up: {text}", flush=True),
        token=_demo_token(DEMO_TENANT),
    )
    print(
        f"ragline up: demo corpus: {written} passages ingested"
        if written
        else "ragline up: demo corpus already loaded",
        flush=True,
    )


def _demo_token(tenant: str) -> str | None:
    """With authentication on and an HMAC key at hand, a short-lived token for loading the
    demo corpus (a public-key setup has no key to sign with: the load is refused)."""
    from ragline.auth import AuthConfig, mint_token
    from ragline.identity import WRITE_SCOPE

    config = AuthConfig()
    if config.mode == "off" or not config.jwt_key:
        return None
    return mint_token(
        config.jwt_key,
        tenant,
        principal="ragline-up",
        scopes=[WRITE_SCOPE],
        ttl_s=600,
        audience=config.jwt_audience,
    )


def _auth_notice() -> str:
    from ragline.auth import AuthConfig

    if AuthConfig().mode == "off":
        return (
            "authentication is OFF (embedded laptop default): any caller that reaches these "
            "ports can claim any tenant. Set RAGLINE_AUTH_MODE=jwt (docs/security.md) before "
            "exposing them."
        )
    return "authentication is ON (jwt): clients send `authorization: Bearer <token>`"


def _stack_tls(args: argparse.Namespace, certificates):
    """(the services' RAGLINE_TLS_*, a command's): the operator's files where
    RAGLINE_TLS_* names them, else under `--tls` the local CA's `certificates`."""
    from ragline.tls import TlsConfig

    configured = TlsConfig()
    configured.check(server=True)
    if configured.on:
        # The operator's certificates: the services and commands share the same files.
        return {}, {k: v for k, v in os.environ.items() if k.startswith("RAGLINE_TLS_")}
    if certificates is None:
        return {}, {}
    return (
        certificates.service_environment(args.tls),
        certificates.client_environment(args.tls),
    )


def _local_certificates(args: argparse.Namespace, common: CommonConfig):
    from ragline_app.certificates import local_authority

    return local_authority(common.data_dir.resolve() / "tls", [args.host])


def _secured_ledger_environment(certificates, credentials) -> dict[str, str]:
    return {
        "RAGLINE_BUDGET_ETCD_CA_FILE": str(certificates.ca),
        "RAGLINE_BUDGET_ETCD_CERT_FILE": str(certificates.service_cert),
        "RAGLINE_BUDGET_ETCD_KEY_FILE": str(certificates.service_key),
        **credentials.budget_environment(),
    }


def _provision_ledger(etcd, credentials) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ragline_app.etcd_server import provision_ledger_user
    from ragline_services.budget.service import BudgetConfig

    setup = provision_ledger_user(
        etcd.endpoint, credentials, BudgetConfig().key_prefix, etcd.certificates
    )
    # `ragline up`'s own loop is running: the setup gets a loop of its own, on a thread.
    with ThreadPoolExecutor(1) as thread:
        try:
            thread.submit(asyncio.run, setup).result()
        except Exception as error:
            raise RuntimeError(f"the local etcd could not be secured: {error}") from error


def _grpcurl_transport(client_tls: dict[str, str]) -> str:
    if client_tls.get("RAGLINE_TLS_MODE", "off") == "off":
        return "-plaintext"
    flags = f"-cacert {client_tls.get('RAGLINE_TLS_CA_FILE', '')}"
    if client_tls["RAGLINE_TLS_MODE"] == "mtls":
        cert, key = client_tls["RAGLINE_TLS_CERT_FILE"], client_tls["RAGLINE_TLS_KEY_FILE"]
        flags += f" -cert {cert} -key {key}"
    return flags
