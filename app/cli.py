"""The `ragline` command: serve one service, run the whole stack, ask a question."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from ragline.config import CommonConfig
from ragline.vocabulary import ModelTier, SearchMode, search_mode_to_proto, tier_to_proto

if TYPE_CHECKING:
    from ragline_app.etcd_server import EtcdServer
    from ragline_app.stack import Stack


def _service_names() -> list[str]:
    from ragline_services.registry import http_service_names, service_names

    return [*service_names(), *http_service_names()]


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
    names = args.only.split(",") if args.only else _service_names()
    unknown = sorted(set(names) - set(_service_names()))
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


def _token_tenant(token: str) -> str | None:
    """The `tenant` claim of a client token, read without verifying it: only to name the
    default tenant of records; every service verifies the token itself."""
    if not token:
        return None
    import jwt

    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return None
    tenant = claims.get("tenant")
    return tenant if isinstance(tenant, str) and tenant else None


def cmd_ingest(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from ragline_app.ingest import Checkpoint, IngestStats, ingest
    from ragline_app.stack import service_address

    common = CommonConfig()
    path = Path(args.path)
    if not path.exists():
        print(f"ragline ingest: {path} does not exist", file=sys.stderr)
        return 2
    args.tenant = args.tenant or _token_tenant(args.token) or "default"
    checkpoint = Checkpoint.for_input(
        common.data_dir / "ingest", path, args.tenant, args.token or ""
    )
    if args.checkpoint:
        checkpoint = Checkpoint(Path(args.checkpoint), checkpoint.source)
    if args.restart:
        checkpoint.path.unlink(missing_ok=True)
        checkpoint.done = 0
    if checkpoint.discarded:
        print(
            f"not resuming from {checkpoint.path}: {checkpoint.discarded}; ingesting from the start"
        )
    if checkpoint.done:
        print(
            f"resuming after record {checkpoint.done}: records 1-{checkpoint.done} of {path} "
            f"were acknowledged for tenant {args.tenant!r} by an earlier run and are skipped "
            f"({checkpoint.path}; --restart ingests them again)"
        )
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=not sys.stdout.isatty(),
        disable=args.quiet,
    ) as bar:
        task = bar.add_task(f"ingest {path.name}", total=None)
        stats = IngestStats()
        try:
            written, bad = asyncio.run(
                ingest(
                    path,
                    retrieval_addr=service_address("retrieval", common.data_dir),
                    embedding_addr=service_address("embedding", common.data_dir),
                    default_tenant=args.tenant,
                    batch_size=args.batch,
                    checkpoint=checkpoint,
                    progress=lambda n: bar.update(task, completed=n),
                    rerank_addr=(
                        None
                        if args.no_rerank_prepare
                        else service_address("rerank", common.data_dir)
                    ),
                    token=args.token or None,
                    notice=lambda text: bar.console.print(f"ragline ingest: {text}"),
                    one_pass=not args.separate_passes,
                    stats=stats,
                )
            )
        except grpc.aio.AioRpcError as error:
            print(
                f"ragline ingest: {error.code().name}: {error.details()} (progress is "
                f"saved; run again to resume)",
                file=sys.stderr,
            )
            return 1
    print(f"ingested {written} documents from {path}")
    if stats.embedded_by_rerank:
        print(
            f"{stats.embedded_by_rerank} of {stats.embedded_by_rerank + stats.embedded} passages "
            "embedded in rerank's token pass (one model run each)"
        )
    if bad:
        report = checkpoint.path.with_suffix(".errors.jsonl")
        report.write_text(
            "".join(json.dumps({"record": b.number, "reason": b.reason}) + "\n" for b in bad)
        )
        print(f"{len(bad)} bad records skipped (listed in {report}):", file=sys.stderr)
        for b in bad[:20]:
            print(f"  record {b.number}: {b.reason}", file=sys.stderr)
    return 0


def _orchestrator_address(args: argparse.Namespace, common: CommonConfig) -> str:
    from ragline_app.stack import service_address

    return args.addr or service_address("orchestrator", common.data_dir)


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


def cmd_ask(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from ragline import deadlines, identity
    from ragline.clients import ServiceClient
    from ragline.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

    common = CommonConfig()
    # With a token the server takes tenant, principal and scopes from it.
    caller = (
        None
        if args.token
        else identity.Caller(
            tenant=args.tenant,
            principal=args.principal,
            scopes=frozenset(s for s in args.scopes.split(",") if s),
        )
    )
    client = ServiceClient(
        orchestrator_pb2_grpc.OrchestratorServiceStub,
        _orchestrator_address(args, common),
        caller=caller,
        token=args.token or None,
    )
    request = orchestrator_pb2.AskRequest(
        question=args.question,
        task_id=args.task_id or "",
        # Unspecified: the server's default tier, which it may escalate.
        tier=common_pb2.MODEL_TIER_UNSPECIFIED
        if args.tier == "unspecified"
        else tier_to_proto(ModelTier(args.tier)),
        allow_degrade=args.allow_degrade,
        max_tokens=args.max_tokens or 0,
        retrieval=orchestrator_pb2.RetrievalOptions(
            mode=search_mode_to_proto(SearchMode(args.mode))
        ),
    )

    async def run() -> int:
        result = None
        with deadlines.deadline_scope(args.timeout):
            async for message in client.stream("Ask", request):
                event = message.WhichOneof("event")
                if event == "delta" and not args.json:
                    print(message.delta, end="", flush=True)
                elif event == "result":
                    result = message.result
        if result is None:
            print("ragline ask: the stream ended without a result", file=sys.stderr)
            return 1
        if args.json:
            print(json_format.MessageToJson(result))
        else:
            _print_result(result)
        if args.timings:
            from rich.console import Console

            from ragline_app.waterfall import render_text

            Console().print(render_text(result.timing))
        if args.waterfall:
            from ragline_app.waterfall import render_png

            render_png(result.timing, Path(args.waterfall), title=args.question)
            print(f"waterfall written to {args.waterfall}")
        return 0 if result.status.state != common_pb2.ANSWER_STATE_INCOMPLETE else 3

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as error:
        print(f"ragline ask: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except Exception as error:  # DeadlineExceeded before calling, connection errors
        print(f"ragline ask: {error}", file=sys.stderr)
        return 1


def _print_result(result) -> None:
    from ragline.v1 import common_pb2

    print()
    state = common_pb2.AnswerState.Name(result.status.state).removeprefix("ANSWER_STATE_")
    reason = f" ({result.status.reason})" if result.status.reason else ""
    print(f"\n[{state}{reason}]")
    if result.status.detail:
        print(f"  {result.status.detail}")
    if result.draft_answer:
        # The text streamed above failed its checks: say so beside it, never as an answer.
        print(f"  unverified draft (not an answer): {result.draft_answer}")
    if result.citations:
        print("sources:")
    for citation in result.citations:
        snippet = (
            citation.snippet if len(citation.snippet) <= 160 else citation.snippet[:157] + "..."
        )
        print(f"  {citation.marker} {citation.title} ({citation.document_id} v{citation.version})")
        print(f"      {snippet}")
    used = result.budget.used
    if result.budget.task_id:
        print(
            f"budget: {used.input_tokens} input + {used.output_tokens} output tokens, "
            f"{used.calls} model calls, cost {used.cost_micros} micros "
            f"(task {result.budget.task_id})"
        )
    cache = result.cache
    if cache.answer_hit or cache.retrieval_hits or cache.tool_hits:
        layers = ["answer"] if cache.answer_hit else []
        layers += [f"retrieval x{cache.retrieval_hits}"] if cache.retrieval_hits else []
        layers += [f"tool x{cache.tool_hits}"] if cache.tool_hits else []
        saved_ms = sum(s.time.ToMilliseconds() for s in cache.saved)
        tokens = sum(s.input_tokens + s.output_tokens for s in cache.saved)
        generation = [s for s in cache.saved if s.HasField("prefill")]
        split = "".join(
            f"; generation prefill {s.prefill.ToMilliseconds()} ms + decode "
            f"{s.decode.ToMilliseconds()} ms"
            for s in generation
        )
        print(f"cache: {', '.join(layers)} hit, saved ~{saved_ms} ms and {tokens} tokens{split}")
    timing = result.timing
    if timing.end_to_end.ToNanoseconds():
        print(
            f"time: {timing.end_to_end.ToMilliseconds()} ms end to end; critical path "
            f"{' -> '.join(timing.critical_path)} (lower bound "
            f"{timing.critical_path_lower_bound.ToMilliseconds()} ms, ratio "
            f"{timing.overhead_ratio:.2f})" + (f"; model {result.model}" if result.model else "")
        )


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


def cmd_health(args: argparse.Namespace) -> int:
    from ragline_app.stack import service_address, service_status

    common = CommonConfig()
    names = _service_names()

    async def run() -> dict[str, tuple[str, str]]:
        addresses = {n: service_address(n, common.data_dir) for n in names}
        statuses = await asyncio.gather(
            *(service_status(n, a, args.timeout) for n, a in addresses.items())
        )
        return {n: (addresses[n], s) for n, s in zip(names, statuses, strict=True)}

    results = asyncio.run(run())
    if args.json:
        print(json.dumps({n: {"address": a, "status": s} for n, (a, s) in results.items()}))
    else:
        for name, (address, status) in results.items():
            print(f"{name:<13} {address:<22} {status}")
    return 0 if all(s == "SERVING" for _, s in results.values()) else 1


def cmd_top(args: argparse.Namespace) -> int:
    from ragline_app.stack import read_state_metrics
    from ragline_app.top import run

    common = CommonConfig()
    endpoints = dict(item.split("=", 1) for item in args.metrics) or read_state_metrics(
        common.data_dir / "up.json"
    )
    if not endpoints:
        print(
            "ragline top: no metrics endpoints: start the stack with `ragline up` (it serves "
            "and records them), or pass --metrics NAME=URL for each service",
            file=sys.stderr,
        )
        return 2
    try:
        run(endpoints, args.interval, frames=args.frames)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from ragline_app.eval_data import DATA_SETS, DEFAULT_SETS, DataError, data_dir, eval_file, fetch

    if args.action == "list":
        for name, data_set in DATA_SETS.items():
            path = eval_file(name)
            where = str(path) if path.exists() else "-"
            print(f"{name:<26} {data_set.licence:<13} {where}")
            print(f"{'':<26} {data_set.what} (from {data_set.archive.filename})")
        print(f"(`ragline data fetch` writes to {data_dir()}; RAGLINE_EVAL_DATA_DIR moves it)")
        return 0
    into = Path(args.into) if args.into else data_dir()
    try:
        fetch(args.names or list(DEFAULT_SETS), into)
    except DataError as error:
        print(f"ragline data fetch: {error}", file=sys.stderr)
        return 1
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from ragline_app.doctor import FAIL, Options, render, run_checks

    findings = run_checks(Options(args.purpose, args.base_port, args.host))
    print(render(findings))
    failed = [f.check for f in findings if f.state == FAIL]
    if failed:
        print(f"ragline doctor: fix {', '.join(failed)} first (advice above)", file=sys.stderr)
        return 1
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from ragline.models import ModelError, ModelStore

    store = ModelStore(Path(args.model_dir) if args.model_dir else None)
    if args.action == "list":
        for name, spec in sorted(store.specs.items()):
            if spec.parts:
                source = f"{len(spec.parts)} parts from {spec.parts[0].package}..."
            elif spec.downloadable:
                source = f"{spec.package}=={spec.version}"
            elif spec.derive:
                source = f"derived from {spec.derived_from} ({spec.derive})"
            else:
                source = f"export of {spec.derived_from} ({spec.export})"
            state = "ready" if store.is_ready(name) else "-"
            print(f"{name:<24} {spec.kind:<15} {state:<6} {source:<40} {spec.licence}")
        print(f"(store: {store.root})")
        return 0
    names = args.names or default_models()
    failed = False
    for name in names:
        try:
            if args.action == "prepare":
                store.prepare(name)
            else:
                store.verify(name)
                print(f"{name}: verified")
        except ModelError as error:
            print(f"ragline models {args.action}: {error}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


def default_models() -> list[str]:
    """The models the services run with their settings as configured now (defaults and
    RAGLINE_* variables): what `ragline up` needs ready."""
    from ragline_services.embedding.service import EmbeddingConfig
    from ragline_services.generation.service import GenerationConfig
    from ragline_services.rerank.service import RerankConfig

    rerank = RerankConfig()
    names = [
        EmbeddingConfig().model,
        rerank.token_model,
        rerank.cross_encoder_model,
        GenerationConfig().small_model,
    ]
    return list(dict.fromkeys(n for n in names if n))


def _name_equals_url(value: str) -> str:
    name, _, url = value.partition("=")
    if not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=http://host:port/metrics, got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from ragline import __version__

    parser = argparse.ArgumentParser(prog="ragline", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ragline {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service in the foreground")
    serve.add_argument("service", choices=_service_names())
    serve.add_argument(
        "--host", help="listen address (default RAGLINE_<SERVICE>_HOST or 127.0.0.1)"
    )
    serve.add_argument("--port", type=int, help="listen port (default RAGLINE_<SERVICE>_PORT)")
    serve.set_defaults(func=cmd_serve)

    openapi = sub.add_parser("openapi", help="print the HTTP gateway's OpenAPI file")
    openapi.add_argument("--out", help="write it to this file instead")
    openapi.set_defaults(func=cmd_openapi)

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

    ask = sub.add_parser("ask", help="ask the orchestrator a question")
    ask.add_argument("question")
    ask.add_argument("--addr", help="orchestrator host:port (default: the running `ragline up`)")
    ask.add_argument("--timeout", type=float, default=60.0, help="deadline in seconds")
    ask.add_argument("--tenant", default="default", help="without --token (auth off) only")
    ask.add_argument(
        "--token",
        default=os.environ.get("RAGLINE_TOKEN", ""),
        help="client token (JWT) when authentication is on (default: $RAGLINE_TOKEN)",
    )
    ask.add_argument("--principal", default="cli")
    ask.add_argument("--scopes", default="", help="comma-separated visibility scopes")
    ask.add_argument("--task-id", help="idempotency id of the task (default: generated)")
    ask.add_argument("--json", action="store_true", help="print the final result as JSON")
    ask.add_argument("--timings", action="store_true", help="draw where the time went")
    ask.add_argument("--waterfall", metavar="FILE.png", help="write the timing waterfall as a PNG")
    ask.add_argument("--tier", choices=["unspecified", *ModelTier], default="unspecified")
    ask.add_argument("--mode", choices=list(SearchMode), default=SearchMode.HYBRID)
    ask.add_argument("--max-tokens", type=int, help="most answer tokens (default: server's)")
    ask.add_argument(
        "--allow-degrade",
        action="store_true",
        help="let the server drop optional steps to meet the deadline or budget",
    )
    ask.set_defaults(func=cmd_ask)

    ingest = sub.add_parser("ingest", help="load documents (SQuAD JSON or JSONL) into retrieval")
    ingest.add_argument("path")
    ingest.add_argument(
        "--tenant",
        default=None,
        help="tenant of records that name none (default: the token's, else 'default')",
    )
    ingest.add_argument(
        "--token",
        default=os.environ.get("RAGLINE_TOKEN", ""),
        help="client token (JWT) when authentication is on (default: $RAGLINE_TOKEN)",
    )
    ingest.add_argument("--batch", type=int, default=64)
    ingest.add_argument("--checkpoint", help="resume file (default .ragline/ingest/...)")
    ingest.add_argument("--restart", action="store_true", help="ignore an earlier checkpoint")
    ingest.add_argument("--quiet", action="store_true", help="no progress bar")
    ingest.add_argument(
        "--no-rerank-prepare",
        action="store_true",
        help="do not send documents to rerank's Prepare (token vectors then come on first use)",
    )
    ingest.add_argument(
        "--separate-passes",
        action="store_true",
        help="embed every passage through the embedding service even when rerank's token "
        "pass runs the same model (two model runs per passage instead of one)",
    )
    ingest.set_defaults(func=cmd_ingest)

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

    models = sub.add_parser("models", help="list, fetch and verify models (see the manifest)")
    models.add_argument("action", choices=["list", "prepare", "verify"])
    models.add_argument(
        "names", nargs="*", help="models (default: those the services' settings name)"
    )
    models.add_argument(
        "--model-dir", help="model store (default RAGLINE_MODEL_DIR or ~/.cache/ragline/models)"
    )
    models.set_defaults(func=cmd_models)

    top = sub.add_parser(
        "top", help="live view of every service from its metrics (calls, latency, queues)"
    )
    top.add_argument(
        "--metrics",
        action="append",
        default=[],
        type=_name_equals_url,
        metavar="NAME=URL",
        help="a service's /metrics URL (repeat; default: those `ragline up` recorded)",
    )
    top.add_argument("--interval", type=float, default=2.0, help="seconds between redraws")
    top.add_argument(
        "--frames", type=int, default=None, help="stop after this many redraws (default: Ctrl-C)"
    )
    top.set_defaults(func=cmd_top)
    data = sub.add_parser(
        "data", help="the evaluation data sets the measuring tools read (list, fetch)"
    )
    data.add_argument("action", choices=("list", "fetch"))
    data.add_argument(
        "names",
        nargs="*",
        help="data sets (default: SQuAD dev, new_wiki, Wikipedia leads; `ragline data list`)",
    )
    data.add_argument("--into", help="folder (default RAGLINE_EVAL_DATA_DIR or <cache>/data)")
    data.set_defaults(func=cmd_data)
    doctor = sub.add_parser(
        "doctor", help="check what the stack needs on this machine, with what to do for each"
    )
    doctor.add_argument(
        "--for",
        dest="purpose",
        choices=("up", "test"),
        default="up",
        help="up: what `ragline up` needs (default); test: also what `make test` needs",
    )
    doctor.add_argument(
        "--base-port", type=int, default=None, help="the ports `ragline up` will take (0: free)"
    )
    doctor.add_argument("--host", default="127.0.0.1")
    doctor.set_defaults(func=cmd_doctor)
    health = sub.add_parser("health", help="health of every service")
    health.add_argument("--timeout", type=float, default=2.0)
    health.add_argument("--json", action="store_true")
    health.set_defaults(func=cmd_health)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in ("serve", "up", "etcd-setup"):
        from ragline_app.stack import use_stack_tls

        use_stack_tls(CommonConfig().data_dir)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
