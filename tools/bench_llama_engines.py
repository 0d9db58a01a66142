"""Two llama-server binaries side by side, on the flags the generation service starts them
with: prefill and decode tokens/s, time to first token, slot save/restore and n-gram
speculation, per model and thread count, all rows from one run.

    .venv/bin/python tools/bench_llama_engines.py --engine prebuilt=PATH [--engine NAME=PATH]

The first engine is the baseline (the one the service finds: the build for this machine
where there is one). For each (model, threads) the engines run alone, one after the other, in
rounds that alternate their order, on the same prompts. Speeds and the prefill time
(what a cold TTFT is made of) are llama-server's own `timings`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ragline.config import CommonConfig
from ragline.models.store import ModelStore
from ragline_app.datasets import load_squad
from ragline_app.eval_data import eval_file
from ragline_services.generation.llama_engine import (
    EngineSettings,
    LlamaServerEngine,
    find_llama_server,
)

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "Answer the question using only the evidence. Quote the evidence where you can."


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def prompts(path: Path, count: int) -> list[str]:
    """RAG prompts of ~4 SQuAD paragraphs (~500-700 tokens) whose answers quote them."""
    passages, questions = load_squad(path)
    out = []
    for index in range(count):
        group = passages[index * 4 : index * 4 + 4]
        evidence = "\n\n".join(p.text for p in group)
        question = next(q.text for q in questions if q.passage_id == group[0].id)
        out.append(
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nEvidence:\n{evidence}"
            f"\n\nQuestion: {question}<|im_end|>\n<|im_start|>assistant\n"
        )
    return out


async def completion(http: httpx.AsyncClient, prompt: str, tokens: int, **extra) -> dict:
    body = {
        "prompt": prompt,
        "n_predict": tokens,
        "temperature": 0.0,
        "cache_prompt": False,
        "id_slot": 0,
        **extra,
    }
    started = time.perf_counter()
    reply = await http.post("/completion", json=body, timeout=600)
    reply.raise_for_status()
    data = reply.json()
    data["wall_s"] = time.perf_counter() - started
    return data


async def slot_round_trip(engine: LlamaServerEngine, http: httpx.AsyncClient, prompt: str) -> str:
    """Prefill a slot, save it, erase it, restore it: 'ok (N tokens)' or why not."""
    tokens = await engine.tokenize(prompt)
    await engine.prefill(0, tokens)
    saved = await engine.save_slot(0, "bench-slot.bin")
    await engine.erase_slot(0)
    restored = await engine.restore_slot(0, "bench-slot.bin")
    # The restored state must be used: the next completion's prompt is read from the cache.
    reply = await completion(http, prompt, 1, cache_prompt=True)
    cached = reply.get("tokens_cached", 0) or reply.get("timings", {}).get("cache_n", 0)
    if saved == restored == len(tokens) and cached >= len(tokens) - 1:
        return f"ok ({restored} tokens)"
    return f"FAILED (saved {saved}, restored {restored}, cached {cached} of {len(tokens)})"


async def measure_one(args, name: str, engine: LlamaServerEngine, texts, results) -> None:
    """Starts `engine` alone, runs every prompt through it, stops it."""
    started = time.perf_counter()
    await engine.start()
    print(f"  {name}: ready in {time.perf_counter() - started:.1f} s", flush=True)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{engine.port}") as http:
            await completion(http, texts[0], 4)  # warm-up: pages the weights in
            for text in texts:
                full = await completion(http, text, args.tokens, **{"speculative.n_max": 0})
                timings = full["timings"]
                results["prefill"].append(timings["prompt_per_second"])
                results["decode"].append(timings["predicted_per_second"])
                results["ttft"].append(timings["prompt_ms"] / 1000)
                # The same prompt again, read from the slot's cache: only decoding differs.
                spec = await completion(http, text, args.tokens, cache_prompt=True)
                results["spec"].append(
                    (
                        spec["timings"]["predicted_per_second"],
                        spec["timings"].get("draft_n", 0),
                        spec["timings"].get("draft_n_accepted", 0),
                        spec["content"] == full["content"],
                    )
                )
            results["slots"] = await slot_round_trip(engine, http, texts[0])
    finally:
        await engine.close()


async def measure_pair(args, names, binaries, model: Path, threads: int, texts, logs: Path):
    """Each engine alone on the machine (an idle llama-server's threads still poll for
    work), in rounds that alternate which goes first."""
    results = {name: {"prefill": [], "decode": [], "ttft": [], "spec": []} for name in names}
    for round_ in range(args.rounds):
        order = list(zip(names, binaries, strict=True))
        if round_ % 2:
            order.reverse()
        for name, binary in order:
            settings = EngineSettings(
                model_path=model,
                binary=binary,
                slots=1,
                context_per_slot=2048,
                threads=threads,
                speculation="ngram",
            )
            log = logs / f"{name}-{model.parent.name}-{threads}-{round_}.log"
            engine = LlamaServerEngine(settings, free_port(), log)
            await measure_one(args, name, engine, texts, results[name])
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", action="append", default=[], help="NAME=PATH (repeatable)")
    parser.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--squad", type=Path, default=eval_file("squaddev_v1.1.json"))
    args = parser.parse_args()

    common = CommonConfig()
    baseline = find_llama_server(common.cache_dir)
    if baseline is None:
        print("no llama-server: `make llama-server`", file=sys.stderr)
        return 2
    engines = [(baseline.kind, baseline.path)]
    for item in args.engine:
        name, _, path = item.partition("=")
        engines.append((name, Path(path)))
    names = [name for name, _ in engines]
    binaries = [path for _, path in engines]
    for name, binary in engines:
        if not binary.exists():
            print(f"{name}: no binary at {binary}", file=sys.stderr)
            return 2
    store = ModelStore()
    texts = prompts(args.squad, args.prompts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as logs:
        for model_name in args.models.split(","):
            model = store.gguf_file(model_name)
            for threads in (int(t) for t in args.threads.split(",")):
                print(f"{model_name}, {threads} thread(s)")
                results = asyncio.run(
                    measure_pair(args, names, binaries, model, threads, texts, Path(logs))
                )
                base = results[names[0]]
                for name in names:
                    r = results[name]
                    spec_rate = statistics.median(s[0] for s in r["spec"])
                    drafted = sum(s[1] for s in r["spec"])
                    accepted = sum(s[2] for s in r["spec"])
                    same = all(s[3] for s in r["spec"])
                    row = [
                        model_name,
                        str(threads),
                        name,
                        _cell(r["prefill"], base["prefill"]),
                        _cell(r["decode"], base["decode"]),
                        _cell(r["ttft"], base["ttft"], scale=1000, unit=" ms"),
                        f"{spec_rate:.1f} ({accepted}/{drafted} accepted"
                        f"{', same text' if same else ', TEXT DIFFERS'})",
                        r["slots"],
                    ]
                    rows.append(row)
                    print("| " + " | ".join(row) + " |", flush=True)
    print(
        "\n| model | threads | engine | prefill tok/s (x baseline) | decode tok/s (x baseline) "
        "| prefill ms, p50 (x baseline) | n-gram speculation: decode tok/s | slot save/restore |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


def _cell(values, baseline, scale=1.0, unit="") -> str:
    mine, theirs = statistics.median(values), statistics.median(baseline)
    return f"{mine * scale:.1f}{unit} ({mine / theirs:.3f})"


if __name__ == "__main__":
    sys.exit(main())
