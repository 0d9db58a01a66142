"""`ragline ask`: a question to the orchestrator, its answer streamed, then the state,
sources, budget and timing."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import grpc

from ragline.config import CommonConfig
from ragline.vocabulary import ModelTier, SearchMode, search_mode_to_proto, tier_to_proto


def register(sub: argparse._SubParsersAction) -> None:
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


def _orchestrator_address(args: argparse.Namespace, common: CommonConfig) -> str:
    from ragline_app.stack import service_address

    return args.addr or service_address("orchestrator", common.data_dir)
