"""Benchmark of the generation service on llama.cpp (CPU), all rows from one run.

    .venv/bin/python tools/bench_generation.py [--model qwen2.5-coder-0.5b] [--tokens 64]

1. overhead: TTFT and decode tok/s through the gRPC service vs the bare llama-server it
   runs (same prompt, greedy, speculation off), as ratios.
2. prefix cache: TTFT of a RAG prompt (system + evidence + question) cold (slot erased)
   vs warm (same tenant, same evidence, a new question).
3. speculation: n-gram prompt lookup vs plain decoding on RAG answers that quote their
   evidence: decode tok/s ratio, acceptance rate, and whether the outputs are identical.
4. batching: aggregate tok/s at concurrency 1/2/4/8 with max_num_seqs=8 (continuous
   batching) vs max_num_seqs=1 (one at a time).
Failed or unfinished requests are counted in every row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import grpc
import httpx

from ragline.v1 import generation_pb2, generation_pb2_grpc
from ragline_app.datasets import load_squad
from ragline_app.stack import source_pythonpath, spawn_service

REPO = Path(__file__).resolve().parents[1]


def rag_prompt(evidence: str, question: str) -> list[tuple[int, str]]:
    return [
        (
            generation_pb2.ROLE_SYSTEM,
            "Answer the question using only the evidence. Quote the evidence where you can.",
        ),
        (generation_pb2.ROLE_USER, f"Evidence:\n{evidence}\n\nQuestion: {question}"),
    ]


def chat_request(turns, max_tokens, speculation=generation_pb2.SPECULATION_OFF):
    request = generation_pb2.GenerateRequest(max_tokens=max_tokens, speculation=speculation)
    for role, content in turns:
        request.chat.messages.add(role=role, content=content)
    return request


async def run_one(stub, request, tenant="bench"):
    started = time.perf_counter()
    first = None
    final = None
    async for message in stub.Generate(
        request, timeout=600, metadata=(("x-ragline-tenant", tenant),)
    ):
        if message.first_token and first is None:
            first = time.perf_counter() - started
        if message.HasField("final"):
            final = message.final
    return {"ttft_s": first, "total_s": time.perf_counter() - started, "final": final}


async def answers(address: str, cases, max_tokens: int, tier: int = 0) -> list:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        finals = []
        for evidence, qs in cases:
            request = chat_request(rag_prompt(evidence, qs[0]), max_tokens)
            request.tier = tier
            finals.append((await run_one(stub, request))["final"])
        return finals


def engine_port(service_log: Path) -> int:
    """The llama-server port of the service's small tier (it logs `engine.ready`)."""
    for line in service_log.read_text().splitlines():
        if '"engine.ready"' in line:
            return int(json.loads(line)["port"])
    raise SystemExit(f"no engine.ready line in {service_log}")


async def bare_engine(port: int, prompt: str, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        started = time.perf_counter()
        first = None
        timings = {}
        async with client.stream(
            "POST",
            "/completion",
            json={
                "prompt": prompt,
                "n_predict": max_tokens,
                "stream": True,
                "cache_prompt": False,
                "temperature": 0.0,
                "speculative.n_max": 0,
                "id_slot": 0,
            },
        ) as reply:
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[6:])
                if data.get("content") and first is None:
                    first = time.perf_counter() - started
                if data.get("stop"):
                    timings = data.get("timings", {})
        return {
            "ttft_s": first,
            "total_s": time.perf_counter() - started,
            "tokens_per_s": timings.get("predicted_per_second", 0.0),
        }


@contextlib.contextmanager
def generation_service(env: dict[str, str], log_path: Path):
    process, address = spawn_service("generation", env, log_path)
    try:
        yield address
    finally:
        process.terminate()
        process.wait()


def engine_rss_mib(port: int) -> float:
    """Resident memory of the llama-server listening on `port` (found by its command line)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    return float("nan")


def stage_s(final, name: str) -> float:
    for stage in final.timing.stages:
        if stage.name == name:
            return stage.duration.seconds + stage.duration.nanos / 1e9
    return float("nan")


async def prompt_of(stub, texts: list[str], tokens: int) -> str:
    """Joins `texts` and cuts the result to about `tokens` tokens of the service's model."""
    text = "\n\n".join(texts)
    chars = tokens * 4
    for _ in range(4):
        counted = (
            await stub.CountTokens(
                generation_pb2.CountTokensRequest(prompt=text[:chars]),
                metadata=(("x-ragline-tenant", "bench"),),
            )
        ).tokens
        if abs(counted - tokens) <= tokens * 0.02:
            break
        chars = int(chars * tokens / counted)
    return text[:chars]


def answer_request(evidence: str, question: str):
    """The orchestrator's answer prompt for `evidence` (a short answer, one line)."""
    from ragline_services.orchestrator.evidence import SYSTEM_PROMPT

    turns = [
        (generation_pb2.ROLE_SYSTEM, SYSTEM_PROMPT),
        (generation_pb2.ROLE_USER, f"Evidence:\n{evidence}\n\nQuestion: {question}"),
    ]
    request = chat_request(turns, 24)
    request.sampling.stop.append("\n")
    return turns, request


def flash_rows(args, passages, logs: Path, base_env: dict, rows: list[str]) -> None:
    """Prefill tok/s with llama.cpp flash attention on vs off at 512 / 2k / 4k tokens."""
    sizes = [int(x) for x in args.prefill_sizes.split(",")]
    speed: dict[tuple[str, int], float] = {}
    for flash in ("off", "on"):
        env = {
            **base_env,
            "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
            "RAGLINE_GENERATION_CONTEXT_PER_SEQ": str(max(sizes) + 256),
            "RAGLINE_GENERATION_FLASH_ATTN": flash,
        }
        with generation_service(env, logs / f"bench-generation-flash-{flash}.log") as address:

            async def measure(address=address, flash=flash):
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = generation_pb2_grpc.GenerationServiceStub(channel)
                    for size in sizes:
                        rates = []
                        for round_ in range(args.rounds):
                            start = (round_ * 17 + size // 64) % (len(passages) - 40)
                            texts = [p.text for p in passages[start : start + 40]]
                            prompt = await prompt_of(stub, texts, size)
                            # A new tenant each time: the slot is erased, the prefill cold.
                            reply = await run_one(
                                stub,
                                generation_pb2.GenerateRequest(prompt=prompt, max_tokens=1),
                                tenant=uuid.uuid4().hex,
                            )
                            final = reply["final"]
                            rates.append(final.usage.input_tokens / stage_s(final, "prefill"))
                        speed[(flash, size)] = statistics.median(rates)

            asyncio.run(measure())
    for size in sizes:
        on, off = speed[("on", size)], speed[("off", size)]
        rows.append(
            f"| prefill tok/s at {size} prompt tokens: flash attention on vs off | "
            f"{on:.0f} vs {off:.0f} | {on / off:.2f}x |"
        )


def cold_rows(args, passages, questions, logs: Path, base_env: dict, rows: list[str]) -> None:
    """Cold TTFT of the orchestrator's answer prompt with ~600 tokens of evidence, per engine
    configuration: the issue's default (1 thread per tier, the portable build), threads
    from the cores, and this machine's build. All services run at once and take the
    requests in turns, so the machine's noise falls on every configuration alike."""
    from ragline.config import CommonConfig
    from ragline_services.generation.llama_engine import PORTABLE, default_llama_cache

    common = CommonConfig()
    portable = default_llama_cache(common.cache_dir, PORTABLE) / "llama-server"
    configs = [
        ("1 thread, portable build", {"RAGLINE_GENERATION_THREADS": "1"}),
        ("threads from cores, portable build", {}),
        ("threads from cores, this machine's build (default)", None),
    ]
    if not portable.exists():
        rows.append(f"| cold TTFT | no portable build at {portable}: rows skipped | |")
        return
    with contextlib.ExitStack() as stack:
        addresses = []
        for index, (_, extra) in enumerate(configs):
            env = {
                **base_env,
                "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
                "RAGLINE_GENERATION_KV_STORE": "false",
                **(extra or {}),
            }
            if extra is not None:
                env["RAGLINE_GENERATION_LLAMA_SERVER"] = str(portable)
            log_path = logs / f"bench-generation-cold-{index}.log"
            addresses.append(stack.enter_context(generation_service(env, log_path)))

        async def measure():
            ttfts: list[list[float]] = [[] for _ in configs]
            tokens: list[int] = []
            async with contextlib.AsyncExitStack() as channels:
                stubs = [
                    generation_pb2_grpc.GenerationServiceStub(
                        await channels.enter_async_context(grpc.aio.insecure_channel(a))
                    )
                    for a in addresses
                ]
                for round_ in range(args.rounds + 1):
                    start = (round_ * 13) % (len(passages) - 12)
                    texts = [f"[{i + 1}] {p.text}" for i, p in enumerate(passages[start:][:12])]
                    evidence = await prompt_of(stubs[0], texts, args.cold_tokens)
                    _, request = answer_request(evidence, questions[round_].text)
                    for index, stub in enumerate(stubs):
                        # A new tenant: the slot is erased, nothing of the prompt is cached.
                        reply = await run_one(stub, request, tenant=uuid.uuid4().hex)
                        if round_ == 0:
                            continue  # warm-up: a fresh engine's first request allocates
                        ttfts[index].append(reply["ttft_s"])
                        tokens.append(reply["final"].usage.input_tokens)
            return ttfts, tokens

        ttfts, tokens = asyncio.run(measure())
    base = statistics.median(ttfts[0])
    for (label, _), values in zip(configs, ttfts, strict=True):
        median = statistics.median(values)
        rows.append(
            f"| cold TTFT, answer prompt of {statistics.median(tokens):.0f} tokens: {label} | "
            f"{median * 1000:.0f} ms (min {min(values) * 1000:.0f}) | {base / median:.2f}x |"
        )


def buried_cases(passages, questions, count: int, distractors: int):
    """(question, gold passage, other passages): SQuAD dev questions whose paragraph is
    buried among paragraphs of other articles."""
    by_id = {p.id: p for p in passages}
    article = lambda passage_id: passage_id.rsplit(":", 1)[0]  # noqa: E731
    cases = []
    for i, question in enumerate(questions[: count * 7 : 7]):
        gold = by_id[question.passage_id]
        others = [p for p in passages if article(p.id) != article(gold.id)]
        offset = (i * 13) % max(len(others) - distractors, 1)
        cases.append((question, gold, others[offset : offset + distractors]))
    return cases


def kv_type_rows(args, passages, questions, logs: Path, base_env: dict, rows: list[str]) -> None:
    """Per KV cache type: engine memory, decode tok/s and answer F1 with the gold paragraph
    buried in about `--long-tokens` tokens of other passages."""
    from ragline.answer_match import answer_f1
    from ragline_services.orchestrator.evidence import strip_markers

    cases = buried_cases(passages, questions, args.long_questions, distractors=40)
    results = {}
    for cache_type in args.kv_types.split(","):
        env = {
            **base_env,
            "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
            "RAGLINE_GENERATION_CONTEXT_PER_SEQ": str(args.long_tokens + 512),
            "RAGLINE_GENERATION_FLASH_ATTN": "on",  # a quantized V cache needs it
            "RAGLINE_GENERATION_CACHE_TYPE_K": cache_type,
            "RAGLINE_GENERATION_CACHE_TYPE_V": cache_type,
        }
        log_path = logs / f"bench-generation-kv-{cache_type}.log"
        with generation_service(env, log_path) as address:
            port = engine_port(log_path)
            idle_rss = engine_rss_mib(port)

            async def measure(address=address):
                f1s, speeds, tokens = [], [], []
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = generation_pb2_grpc.GenerationServiceStub(channel)
                    for question, gold, others in cases:
                        # the gold paragraph in the middle of the distractors
                        middle = len(others) // 2
                        texts = [p.text for p in others[:middle]] + [gold.text]
                        texts += [p.text for p in others[middle:]]
                        evidence = await prompt_of(stub, texts, args.long_tokens)
                        if gold.text not in evidence:  # cut off: put it back in the middle
                            half = len(evidence) // 2
                            evidence = evidence[:half] + "\n\n" + gold.text + evidence[half:]
                            evidence = evidence[: len(evidence) - len(gold.text)]
                        turns, request = answer_request(evidence, question.text)
                        tenant = uuid.uuid4().hex
                        final = (await run_one(stub, request, tenant=tenant))["final"]
                        answer = strip_markers(final.text).strip()
                        f1s.append(max(answer_f1(answer, g) for g in question.answers))
                        tokens.append(final.usage.input_tokens)
                        # decode speed at long context: 64 tokens after the same prompt
                        # (same tenant: the prompt's KV is reused, only decoding is new)
                        if len(speeds) < 3:
                            long = chat_request(turns, 64)
                            final = (await run_one(stub, long, tenant=tenant))["final"]
                            speeds.append(final.decode_tokens_per_second)
                return f1s, speeds, tokens

            f1s, speeds, tokens = asyncio.run(measure())
            results[cache_type] = {
                "f1": statistics.fmean(f1s),
                "decode": statistics.median(speeds),
                "tokens": statistics.median(tokens),
                "rss_idle": idle_rss,
                "rss": engine_rss_mib(port),
            }
    base = results.get("f16")
    for cache_type, r in results.items():
        ratio = f"{r['decode'] / base['decode']:.2f}x decode" if base else ""
        rows.append(
            f"| KV cache {cache_type}: engine RSS idle / after, decode tok/s, F1 "
            f"(gold in ~{r['tokens']:.0f} tokens, {len(cases)} q) | "
            f"{r['rss_idle']:.0f} / {r['rss']:.0f} MiB, {r['decode']:.1f} tok/s, "
            f"F1 {r['f1']:.3f} | {ratio} |"
        )


def store_rows(args, passages, questions, logs: Path, base_env: dict, rows: list[str]) -> None:
    """The hot-prefix KV store: (1) TTFT with a restored ~1k-token prefix (the chat's
    system part: instructions and fixed documents) vs cold, across a service restart, the
    index in a real Redis; (2) hit rate and TTFT on a workload where 30% of questions
    repeat an earlier one. One slot and tenants taking turns, so every request finds its
    slot erased: only the store can skip a prefill."""
    import random
    import tempfile

    from ragline.processes import free_ports
    from ragline_app.redis_server import RedisServer
    from ragline_services.orchestrator.evidence import SYSTEM_PROMPT

    work = Path(tempfile.mkdtemp(prefix="bench-kv-store-", dir=logs))
    redis = RedisServer(work / "redis", free_ports(1)[0])
    redis.start()
    env = {
        **base_env,
        "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
        "RAGLINE_GENERATION_CONTEXT_PER_SEQ": "2048",
        "RAGLINE_GENERATION_KV_STORE_DIR": str(work / "kv"),
        "RAGLINE_GENERATION_CACHE_URL": redis.url,
    }
    try:
        ttft = {"cold": [], "restored": []}
        restored_tokens = []
        with generation_service(env, logs / "bench-generation-store-1.log") as address:

            async def setup(address=address):
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = generation_pb2_grpc.GenerationServiceStub(channel)
                    manual = await prompt_of(stub, [p.text for p in passages[:12]], 1000)
                    system = f"{SYSTEM_PROMPT}\n\nReference documents:\n{manual}"
                    for q in questions[:2]:  # twice: the system part is hot, then saved
                        turns = [
                            (generation_pb2.ROLE_SYSTEM, system),
                            (generation_pb2.ROLE_USER, q.text),
                        ]
                        await run_one(stub, chat_request(turns, 1), tenant="owner")
                    return system

            system = asyncio.run(setup())
        # A restart: a new process, a new llama-server, empty slots.
        with generation_service(env, logs / "bench-generation-store-2.log") as address:

            async def measure(address=address):
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = generation_pb2_grpc.GenerationServiceStub(channel)
                    for i, q in enumerate(questions[10 : 10 + args.rounds]):
                        # cold: another tenant, the same system part (nothing of owner's)
                        turns = [
                            (generation_pb2.ROLE_SYSTEM, system),
                            (generation_pb2.ROLE_USER, q.text),
                        ]
                        cold = await run_one(stub, chat_request(turns, 1), tenant=f"cold-{i}")
                        warm = await run_one(stub, chat_request(turns, 1), tenant="owner")
                        ttft["cold"].append(cold["ttft_s"] or cold["total_s"])
                        ttft["restored"].append(warm["ttft_s"] or warm["total_s"])
                        restored_tokens.append(warm["final"].prefix_store.restored_tokens)

            asyncio.run(measure())
        cold, restored = statistics.median(ttft["cold"]), statistics.median(ttft["restored"])
        rows.append(
            f"| TTFT, ~1k-token prefix restored after a restart vs cold (median of "
            f"{args.rounds}; restored {min(restored_tokens)}-{max(restored_tokens)} tokens) | "
            f"{restored * 1000:.0f} vs {cold * 1000:.0f} ms | {restored / cold:.3f}x |"
        )

        # (2) 30% of questions repeat an earlier one (uniformly: popular ones come back more).
        rng = random.Random(7)
        by_id = {p.id: p for p in passages}
        tenants = [f"tenant-{i}" for i in range(4)]
        asked: list[tuple[str, object]] = []
        workload = []
        fresh = iter(questions[40:])
        for i in range(args.store_requests):
            if asked and rng.random() < 0.3:
                workload.append((*rng.choice(asked), True))
            else:
                item = (tenants[i % len(tenants)], next(fresh))
                asked.append(item)
                workload.append((*item, False))
        outcomes = []
        with generation_service(env, logs / "bench-generation-store-3.log") as address:

            async def drive(address=address):
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = generation_pb2_grpc.GenerationServiceStub(channel)
                    previous = None
                    for tenant, q, repeat in workload:
                        if tenant == previous:  # keep the slot cold: a turn of someone else
                            await run_one(
                                stub,
                                generation_pb2.GenerateRequest(prompt="Hi.", max_tokens=1),
                                tenant="interleave",
                            )
                        evidence = by_id[q.passage_id].text
                        turns = rag_prompt(evidence, q.text)
                        reply = await run_one(stub, chat_request(turns, 8), tenant=tenant)
                        outcomes.append((repeat, reply))
                        previous = tenant

            asyncio.run(drive())
        hits = [r for _, r in outcomes if r["final"].prefix_store.restored_tokens > 0]
        repeats = [r for rep, r in outcomes if rep]
        misses = [r for _, r in outcomes if r["final"].prefix_store.restored_tokens == 0]
        saved = sum(r["final"].prefix_store.saved_tokens > 0 for _, r in outcomes)
        hit_ttft = statistics.median(r["ttft_s"] for r in hits) if hits else float("nan")
        miss_ttft = statistics.median(r["ttft_s"] for r in misses)
        rows.append(
            f"| hit rate, {len(outcomes)} RAG requests, {len(repeats)} repeats (30%), 4 tenants "
            f"| {len(hits)} restored ({len(hits) / len(outcomes):.0%} of requests, "
            f"{len(hits) / max(len(repeats), 1):.0%} of repeats), {saved} saves; TTFT p50 "
            f"{hit_ttft * 1000:.0f} (hit) vs {miss_ttft * 1000:.0f} ms (miss) | "
            f"{hit_ttft / miss_ttft:.2f}x |"
        )

        # (3) The request that makes a prompt hot (its second sighting) against its first,
        # each in an erased slot: what the save costs the request whose prompt it saves,
        # and the next request's wait for the slot (one slot: it waits for any save).
        first_s, hot_s, next_wait_s = [], [], []
        with generation_service(env, logs / "bench-generation-store-4.log") as address:

            async def hot(address=address):
                hello = generation_pb2.GenerateRequest(prompt="Hi.", max_tokens=1)
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = generation_pb2_grpc.GenerationServiceStub(channel)
                    for i, q in enumerate(questions[300 : 300 + args.rounds]):
                        turns = rag_prompt(by_id[q.passage_id].text, q.text)
                        sightings = []
                        for _ in range(2):
                            await run_one(stub, hello, tenant="interleave")  # erases the slot
                            reply = await run_one(stub, chat_request(turns, 8), tenant=f"hot-{i}")
                            sightings.append(reply)
                        assert sightings[1]["final"].prefix_store.saved_tokens > 0
                        after = await run_one(stub, hello, tenant="interleave")
                        first_s.append(sightings[0]["total_s"])
                        hot_s.append(sightings[1]["total_s"])
                        next_wait_s.append(after["final"].timing.queue_wait.ToTimedelta())

            asyncio.run(hot())
        first, made_hot = statistics.median(first_s), statistics.median(hot_s)
        waited = statistics.median(w.total_seconds() for w in next_wait_s)
        rows.append(
            f"| request that makes its prompt hot (saved) vs its first sighting, slot erased "
            f"each time (median of {args.rounds}); the next request's slot wait "
            f"{waited * 1000:.0f} ms | {made_hot * 1000:.0f} vs {first * 1000:.0f} ms | "
            f"{made_hot / first:.2f}x |"
        )
    finally:
        redis.stop()


def weights_rows(args, passages, questions, logs: Path, base_env: dict, rows: list[str]) -> None:
    """Quality and speed of each packaged GGUF (the packages carry one quantization per
    model, so the comparison is across models at the precision each ships): SQuAD dev
    answer F1 with the gold paragraph as the evidence, prefill and decode tok/s."""
    from ragline.answer_match import answer_f1
    from ragline.models import ModelStore
    from ragline_services.orchestrator.evidence import strip_markers

    by_id = {p.id: p for p in passages}
    sample = questions[: args.weights_questions]
    store = ModelStore()
    for model in args.weights_models.split(","):
        description = store.spec(model).description.split(":")[0]
        env = {
            **base_env,
            "RAGLINE_GENERATION_SMALL_MODEL": model,
            "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
            "RAGLINE_GENERATION_KV_STORE": "false",
        }
        with generation_service(env, logs / f"bench-generation-weights-{model}.log") as address:

            async def measure(address=address):
                f1s, prefill, decode = [], [], []
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = generation_pb2_grpc.GenerationServiceStub(channel)
                    for q in sample:
                        evidence = f"[1] {by_id[q.passage_id].text}"
                        _, request = answer_request(evidence, q.text)
                        final = (await run_one(stub, request, tenant=uuid.uuid4().hex))["final"]
                        answer = strip_markers(final.text).strip()
                        f1s.append(max(answer_f1(answer, g) for g in q.answers))
                        prefill.append(final.usage.input_tokens / stage_s(final, "prefill"))
                        if final.usage.output_tokens >= 4:
                            decode.append(final.decode_tokens_per_second)
                return f1s, prefill, decode

            f1s, prefill, decode = asyncio.run(measure())
        rows.append(
            f"| weights {description} ({len(sample)} q, gold paragraph given) | F1 "
            f"{statistics.fmean(f1s):.3f}, prefill {statistics.median(prefill):.0f} tok/s, "
            f"decode {statistics.median(decode) if decode else float('nan'):.1f} tok/s | |"
        )


def base_rows(
    args, cases, logs: Path, base_env: dict, rows: list[str], overhead_only: bool = False
) -> None:
    """Rows 1-4 (overhead, prefix cache, speculation, batching); 1-2 when overhead_only."""
    # 1-2 on one plain service with one slot (one request at a time).
    service_log = logs / "bench-generation-1.log"
    process, address = spawn_service(
        "generation",
        {
            **base_env,
            "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
            "RAGLINE_GENERATION_SMALL_SPECULATION": "none",
        },
        service_log,
    )
    try:
        port = engine_port(service_log)

        async def part1():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                service, bare = [], []
                # warm-up: the first request after a start pays one-off allocations
                warm_evidence, warm_questions = cases[-1]
                await run_one(stub, chat_request(rag_prompt(warm_evidence, warm_questions[0]), 4))
                for index, (evidence, qs) in enumerate(cases[: args.rounds * 2]):
                    turns = rag_prompt(evidence, qs[0])
                    tenant = uuid.uuid4().hex[:8]  # fresh tenant: slot erased, cold
                    service_first = index % 2 == 0  # alternate the order: noise hits both
                    if service_first:
                        service.append(
                            await run_one(stub, chat_request(turns, args.tokens), tenant)
                        )
                    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                        prompt = (
                            await http.post(
                                "/apply-template",
                                json={
                                    "messages": [
                                        {
                                            "role": "system"
                                            if r == generation_pb2.ROLE_SYSTEM
                                            else "user",
                                            "content": c,
                                        }
                                        for r, c in turns
                                    ]
                                },
                            )
                        ).json()["prompt"]
                    bare.append(await bare_engine(port, prompt, args.tokens))
                    if not service_first:
                        service.append(
                            await run_one(stub, chat_request(turns, args.tokens), tenant)
                        )
                return service, bare

        service, bare = asyncio.run(part1())
        s_ttft = statistics.median(r["ttft_s"] for r in service)
        b_ttft = statistics.median(r["ttft_s"] for r in bare)
        s_tps = statistics.median(r["final"].decode_tokens_per_second for r in service)
        b_tps = statistics.median(r["tokens_per_s"] for r in bare)
        rows.append(
            f"| service vs bare engine: TTFT | {s_ttft * 1000:.0f} ms vs "
            f"{b_ttft * 1000:.0f} ms | {s_ttft / b_ttft:.3f}x |"
        )
        rows.append(
            f"| service vs bare engine: decode tok/s | {s_tps:.1f} vs {b_tps:.1f} | "
            f"{s_tps / b_tps:.3f}x |"
        )

        async def part2():
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                cold, warm, cached = [], [], []
                for evidence, qs in cases[: args.rounds]:
                    tenant = uuid.uuid4().hex[:8]
                    first = await run_one(
                        stub, chat_request(rag_prompt(evidence, qs[0]), 4), tenant
                    )
                    second = await run_one(
                        stub, chat_request(rag_prompt(evidence, qs[1]), 4), tenant
                    )
                    cold.append(first["ttft_s"])
                    warm.append(second["ttft_s"])
                    cached.append(
                        second["final"].usage.cached_input_tokens
                        / second["final"].usage.input_tokens
                    )
                return cold, warm, cached

        cold, warm, cached = asyncio.run(part2())
        rows.append(
            f"| warm-prefix vs cold TTFT | {statistics.median(warm) * 1000:.0f} ms vs "
            f"{statistics.median(cold) * 1000:.0f} ms ({statistics.median(cached):.0%}"
            f" of the prompt cached) | "
            f"{statistics.median(warm) / statistics.median(cold):.3f}x |"
        )

        if overhead_only:
            return
        plain = asyncio.run(answers(address, cases[: args.rounds], args.tokens))
    finally:
        process.terminate()
        process.wait()

    # 3. the same answers from a tier that speculates (llama-server decides per process);
    # min acceptance 0 keeps it from falling back, to measure speculation itself.
    process, address = spawn_service(
        "generation",
        {
            **base_env,
            "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
            "RAGLINE_GENERATION_SMALL_SPECULATION": "ngram",
            "RAGLINE_GENERATION_SPECULATION_MIN_ACCEPTANCE": "0",
        },
        logs / "bench-generation-ngram.log",
    )
    try:
        spec = asyncio.run(answers(address, cases[: args.rounds], args.tokens))
        same = sum(a.text == b.text for a, b in zip(plain, spec, strict=True))
        rate = statistics.median(b.speculation.acceptance_rate for b in spec)
        p_tps = statistics.median(a.decode_tokens_per_second for a in plain)
        s_tps = statistics.median(b.decode_tokens_per_second for b in spec)
        rows.append(
            f"| n-gram speculative vs plain decode tok/s | {s_tps:.1f} vs {p_tps:.1f} "
            f"(acceptance {rate:.0%}, identical outputs {same}/{len(plain)}) | "
            f"{s_tps / p_tps:.2f}x |"
        )
    finally:
        process.terminate()
        process.wait()

    # 4. batching: aggregate tok/s at each concurrency, continuous batching vs one at a time.
    results = {}
    for slots in (8, 1):
        process, address = spawn_service(
            "generation",
            {
                **base_env,
                "RAGLINE_GENERATION_MAX_NUM_SEQS": str(slots),
                "RAGLINE_GENERATION_MAX_QUEUE": "64",
                "RAGLINE_GENERATION_SMALL_SPECULATION": "none",
            },
            logs / f"bench-generation-{slots}.log",
        )
        try:
            for level in (int(x) for x in args.levels.split(",")):

                async def drive(level=level, address=address):
                    async with grpc.aio.insecure_channel(address) as channel:
                        stub = generation_pb2_grpc.GenerationServiceStub(channel)
                        started = time.perf_counter()
                        outcomes = await asyncio.gather(
                            *(
                                run_one(
                                    stub,
                                    chat_request(
                                        rag_prompt(
                                            cases[i % len(cases)][0][:400],
                                            cases[i % len(cases)][1][0],
                                        ),
                                        args.tokens,
                                    ),
                                    f"t{i}",
                                )
                                for i in range(level)
                            ),
                            return_exceptions=True,
                        )
                        elapsed = time.perf_counter() - started
                        done = [o for o in outcomes if isinstance(o, dict) and o["final"]]
                        tokens = sum(o["final"].usage.output_tokens for o in done)
                        return tokens / elapsed, len(outcomes) - len(done)

                results[(slots, level)] = asyncio.run(drive())
        finally:
            process.terminate()
            process.wait()
    for level in (int(x) for x in args.levels.split(",")):
        (batched, failed_b), (serial, failed_s) = results[(8, level)], results[(1, level)]
        rows.append(
            f"| aggregate tok/s at concurrency {level}: batched vs one at a time | "
            f"{batched:.1f} vs {serial:.1f} (failed {failed_b}/{failed_s}) | "
            f"{batched / serial:.2f}x |"
        )
    c1 = results[(8, 1)][0]
    c4 = results.get((8, 4), (float("nan"),))[0]
    rows.append(
        f"| batched concurrency 4 vs concurrency 1 (aggregate tok/s) | {c4:.1f} vs "
        f"{c1:.1f} | {c4 / c1:.2f}x |"
    )

    if args.draft:
        runs = {}
        for mode in ("none", "draft", "ngram"):
            process, address = spawn_service(
                "generation",
                {
                    **base_env,
                    "RAGLINE_GENERATION_MAX_NUM_SEQS": "1",
                    "RAGLINE_GENERATION_LARGE_MODEL": "qwen2.5-coder-1.5b",
                    "RAGLINE_GENERATION_LARGE_SPECULATION": mode,
                    "RAGLINE_GENERATION_SPECULATION_MIN_ACCEPTANCE": "0",
                },
                logs / f"bench-generation-large-{mode}.log",
            )
            try:
                runs[mode] = asyncio.run(
                    answers(address, cases[: args.rounds], args.tokens, tier=2)
                )  # MODEL_TIER_LARGE
            finally:
                process.terminate()
                process.wait()
        plain = runs["none"]
        p_tps = statistics.median(a.decode_tokens_per_second for a in plain)
        for mode, label in (("draft", "draft model (0.5B for 1.5B)"), ("ngram", "n-gram on 1.5B")):
            spec = runs[mode]
            same = sum(a.text == b.text for a, b in zip(plain, spec, strict=True))
            rate = statistics.median(b.speculation.acceptance_rate for b in spec)
            d_tps = statistics.median(b.decode_tokens_per_second for b in spec)
            rows.append(
                f"| {label} vs plain decode tok/s | {d_tps:.1f} vs {p_tps:.1f} "
                f"(acceptance {rate:.0%}, identical outputs {same}/{len(plain)}) | "
                f"{d_tps / p_tps:.2f}x |"
            )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", default="1,2,4,8")
    parser.add_argument(
        "--draft",
        action="store_true",
        help="also measure draft-model speculation: the large tier "
        "(qwen2.5-coder-1.5b) drafted by the small model, vs plain",
    )
    parser.add_argument(
        "--parts",
        default="base",
        help="comma-separated: base (overhead, prefix cache, speculation, batching), "
        "overhead (only the first two of base), "
        "flash (prefill with/without flash attention), kvtypes (KV cache types), "
        "store (hot-prefix KV store), weights (each packaged quantization), "
        "cold (cold TTFT per thread count and build)",
    )
    parser.add_argument("--prefill-sizes", default="512,2048,4096")
    parser.add_argument("--kv-types", default="f16,q8_0,q4_0")
    parser.add_argument("--long-tokens", type=int, default=3500)
    parser.add_argument("--long-questions", type=int, default=12)
    parser.add_argument("--store-requests", type=int, default=60)
    parser.add_argument(
        "--weights-models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"
    )
    parser.add_argument("--weights-questions", type=int, default=30)
    parser.add_argument("--cold-tokens", type=int, default=560, help="evidence tokens")
    parser.add_argument(
        "--data", type=Path, default=REPO / "app/ragline_app/data/squad_dev_sample.json"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout: the overhead rows are measured first with its service",
    )
    args = parser.parse_args()
    passages, questions = load_squad(args.data)
    by_passage = {}
    for q in questions:
        by_passage.setdefault(q.passage_id, []).append(q.text)
    # Evidence = the question's passage and the next two of its article, as a RAG prompt
    # with top-3 passages would carry (about 500-700 tokens).
    cases = [
        ("\n\n".join(x.text for x in passages[i : i + 3]), by_passage[p.id])
        for i, p in enumerate(passages[:-2])
        if len(by_passage.get(p.id, [])) >= 2
    ]
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    rows: list[str] = []
    base_env = {
        "RAGLINE_GENERATION_SMALL_MODEL": args.model,
        "RAGLINE_GENERATION_LARGE_MODEL": "",  # one tier measured (the draft rows add one)
        "RAGLINE_GENERATION_CONTEXT_PER_SEQ": "2048",
        "RAGLINE_GENERATION_ENGINE_LOG_DIR": str(logs),
    }

    parts = set(args.parts.split(","))
    if "base" in parts or "overhead" in parts:
        if args.baseline is not None:
            before: list[str] = []
            env = {**base_env, "PYTHONPATH": source_pythonpath(args.baseline)}
            base_rows(args, cases, logs, env, before, overhead_only=True)
            rows += [row.replace("| ", "| before: ", 1) for row in before]
        base_rows(args, cases, logs, base_env, rows, overhead_only="base" not in parts)
    if "flash" in parts:
        flash_rows(args, passages, logs, base_env, rows)
    if "kvtypes" in parts:
        kv_type_rows(args, passages, questions, logs, base_env, rows)
    if "weights" in parts:
        weights_rows(args, passages, questions, logs, base_env, rows)
    if "store" in parts:
        store_rows(args, passages, questions, logs, base_env, rows)
    if "cold" in parts:
        cold_rows(args, passages, questions, logs, base_env, rows)
    print(
        f"\ngeneration on llama-server, model {args.model}, {args.tokens} tokens, greedy, "
        f"{args.rounds} RAG prompts from {args.data.name}"
    )
    print("| measure | values | ratio |\n|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
