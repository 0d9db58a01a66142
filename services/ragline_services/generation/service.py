"""Wiring of the generation service: tiers of llama-server engines, schedulers, servicer.

Why one file of this length: an engine's whole life (started from the settings, watched,
restarted, fallen back from speculation, the large tier left off) reads the one settings
class above it, as every service's service.py does; the scheduling and the generation
itself are their own modules.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Literal

import grpc
import structlog
from pydantic import Field

from ragline.cache import CacheBackend, open_cache
from ragline.config import MiB, ServiceConfig
from ragline.cores import usable_cores
from ragline.errors import FailedPrecondition, Unavailable
from ragline.models import ModelError, ModelStore
from ragline.processes import free_ports
from ragline.server import Periodic, Service, ServiceSpec
from ragline.tls import process_tls_for
from ragline.v1 import generation_pb2, generation_pb2_grpc
from ragline.vocabulary import ModelTier
from ragline_services.generation.engine import GenerationEngine
from ragline_services.generation.generator import Generator, Speculation, Tier
from ragline_services.generation.llama_engine import (
    EngineSettings,
    LlamaServerEngine,
    cpu_build,
    default_llama_cache,
    machine_cpu_flags,
    resolve_llama_server,
)
from ragline_services.generation.memory import (
    MEMORY_FRACTION,
    NotEnoughMemory,
    SlotPlan,
    available_memory,
    model_shape,
    plan_slots,
)
from ragline_services.generation.metrics import GenerationMetrics
from ragline_services.generation.prefix_store import PrefixStore, StoreSettings
from ragline_services.generation.scheduler import SlotScheduler
from ragline_services.generation.servicer import GenerationServicer

log = structlog.get_logger("ragline.generation")


class GenerationConfig(ServiceConfig):
    model_config = ServiceConfig.env_for("generation")
    # Models of the manifest per tier. The large tier answers where the small tier's answer
    # failed its checks (docs/answer-states.md, "Which tiers"); "" serves the small tier
    # alone. Where the large model cannot be fetched, does not fit the memory budget or its
    # engine does not start, the small tier serves alone and the log says why.
    small_model: str = "qwen2.5-coder-0.5b-q8"
    large_model: str = "qwen2.5-coder-1.5b"
    # Where prepared models live (default: the shared RAGLINE_MODEL_DIR).
    model_dir: Path | None = None
    prepare_models: bool = True
    # Sequences decoded together per tier (llama-server slots): a hard cap; the slots a
    # tier gets are fewer when its memory share holds fewer (see generation/memory.py).
    max_num_seqs: int = Field(4, ge=1)
    # Slots beside those (when the memory budget holds them), kept for a light tenant's
    # request (one asking one question at a time while another floods): the other tenants'
    # sequences pause while it runs (generation/pausing.py). 0: none, nothing paused.
    priority_slots: int = Field(1, ge=0)
    # Memory for all tiers' engines (weights, buffers, KV caches) in MiB; 0: half of the
    # memory available when the service starts.
    memory_budget_mb: int = Field(0, ge=0)
    max_queue: int = Field(16, ge=0)
    # One tenant's share of the queue (0: half of it), so no tenant can fill it for all.
    max_queue_per_tenant: int = Field(0, ge=0)
    context_per_seq: int = Field(4096, ge=256)
    # A prompt the context holds is tens of KiB: larger requests are refused before they
    # are parsed (transport cap) or looked at (application cap), not buffered by the MiB.
    max_message_bytes: int = Field(4 * MiB, ge=1024)
    max_request_bytes: int = Field(2 * MiB, ge=1024)
    # Only the orchestrator calls it: an end user's token would skip admission and the
    # task budget.
    client_tokens: bool = False
    # How often each llama-server is checked (process alive, /health): a dead one turns the
    # service NOT_SERVING and is started again; an external one is only reported.
    engine_probe_s: float = Field(2.0, gt=0)
    # Prompt tokens one llama-server step evaluates over all its slots (--batch-size);
    # 0: llama.cpp's default (2048). A step runs to its end: a light tenant's request, or a
    # sequence paused or cancelled, waits for the step under way (at ~220 tokens/s on 2
    # cores, 128 tokens are ~0.6 s, 2048 ~9 s); prefill is as fast (docs/tuning.md).
    batch_tokens: int = Field(128, ge=0)
    # A tenant a light tenant's request held back within 30 s (one flooding beside it) reads
    # its prompts this many tokens per engine step, one such step at a time, so a light
    # request waits for at most one small step, not a whole batch (generation/scheduler.py);
    # 0: off.
    yield_step_tokens: int = Field(64, ge=0)
    # llama-server threads per tier; 0: every core this process may use, for each tier
    # (the other services only compute in short bursts, generation is the steady load;
    # the tiers seldom run at once: `_threads`).
    threads: int = Field(0, ge=0)
    # Speculative decoding per tier: "ngram" is prompt lookup, "draft" uses the small model
    # to draft for the large one. Off on the small tier: its answers are a few words, and
    # verifying drafts cost more than they saved (docs/tuning.md).
    small_speculation: Literal["none", "ngram"] = "none"
    large_speculation: Literal["none", "ngram", "draft"] = "ngram"
    speculation_min_acceptance: float = Field(0.7, ge=0, le=1)
    # llama.cpp flash attention: "model" takes the value measured for the model (the
    # manifest's `flash_attn`; "auto" where none was measured); "auto" lets llama.cpp
    # decide per device. A quantized V cache needs it on (or auto).
    flash_attn: Literal["model", "auto", "on", "off"] = "model"
    # KV cache element types (a quantized V cache needs flash attention on or auto).
    cache_type_k: Literal["f16", "q8_0", "q4_0"] = "f16"
    cache_type_v: Literal["f16", "q8_0", "q4_0"] = "f16"
    engine_log_dir: Path | None = None
    # The hot-prefix KV store (generation/prefix_store.py): saved slot states of prompt
    # prefixes a tenant repeats. Files in kv_store_dir (default <data dir>/kv-store; a
    # shared volume for replicas, and the --slot-save-path of any external llama-server),
    # index in cache_url's Redis (empty: in-process, lost on restart).
    kv_store: bool = True
    kv_store_dir: Path | None = None
    kv_store_ttl_s: float = Field(300.0, gt=0)
    kv_store_max_mb: int = Field(2048, ge=1)
    # Seen this many times by a tenant within the TTL, a prefix is saved.
    kv_store_hot_after: int = Field(2, ge=1)
    # Shorter prefixes are cheaper to prefill than to restore.
    kv_store_min_tokens: int = Field(64, ge=1)
    cache_url: str = ""
    # The llama-server binary: an explicit path, else the build tool's cache folder
    # (default <RAGLINE_CACHE_DIR>/llama.cpp/<build tag>).
    llama_server: Path | None = None
    llama_cache: Path | None = None
    # Which prebuilt engine (services/ragline_services/generation/prebuilt.py: "avx512-amx",
    # "avx2") runs, whatever this CPU's flags say; empty: the fastest one this CPU can run.
    # `make llama-server` reads it too: an image for a mixed cluster sets "avx2".
    prebuilt: Literal["", "avx512-amx", "avx2"] = ""
    # Where the prebuilt engines are unpacked (default: RAGLINE_CACHE_DIR): the image
    # carries every one of them under a read-only folder of its own.
    engines_dir: Path | None = None
    # A llama-server already running per tier (for example a sidecar container), started
    # with the flags this service would use (slots = max_num_seqs + priority_slots,
    # --slot-save-path, --cache-ram 0, --slot-prompt-similarity 0, --batch-size
    # batch_tokens); empty: the service
    # starts its own.
    # Speculation then is whatever that server was started with (no fallback restart).
    small_llama_url: str = ""
    large_llama_url: str = ""
    # "llama": llama-server processes on this machine (CPU). "triton": TensorRT-LLM
    # ensembles on a Triton server (GPU nodes); tiers map to Triton model names.
    engine: Literal["llama", "triton"] = "llama"
    triton_url: str = "127.0.0.1:8001"
    # Reach Triton under TLS with the process's RAGLINE_TLS_* credentials (their CA; the
    # process's certificate under mtls), for a Triton started with --grpc-use-ssl.
    triton_tls: bool = False
    triton_small_model: str = "ensemble"
    triton_large_model: str = ""
    triton_preprocessing_model: str = "preprocessing"


KV_SWEEP_EVERY_S = 60.0


class GenerationService(Service):
    config: GenerationConfig

    def __init__(self, config: GenerationConfig, common) -> None:
        super().__init__(config, common)
        self.engines: list[GenerationEngine] = []
        self._servicer = GenerationServicer()
        self._memory_budget = 0
        self._cache: CacheBackend | None = None
        self._watch = Periodic(config.engine_probe_s, self._watch_engines, "engine-watch")
        # Expired state files go within a minute of their TTL also when no save sweeps.
        self._kv_sweep = Periodic(
            min(config.kv_store_ttl_s, KV_SWEEP_EVERY_S), self._sweep_kv_store, "kv-store-sweep"
        )
        self._engine_problem = ""  # what the last probe found wrong ("" while serving)
        self._engines_down: dict[ModelTier, str] = {}  # why a tier's engine cannot serve

    def register(self, server: grpc.aio.Server) -> None:
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(self._servicer, server)

    async def _tier(
        self, store: ModelStore, name: ModelTier, model: str, speculation: str, draft_model: str
    ) -> Tier:
        cfg = self.config
        if cfg.prepare_models:
            # Downloads and hashes: off the event loop, so health answers meanwhile.
            await asyncio.to_thread(
                store.prepare, model, log=lambda line: log.info("models.prepare", detail=line)
            )
        spec = store.spec(model)
        model_path = store.gguf_file(model)
        context = min(cfg.context_per_seq, int(spec.extra.get("context", cfg.context_per_seq)))
        plan, priority_slots = await self._slot_plan(name, model, model_path, context)
        draft_path = None
        if speculation == "draft":
            draft_path = store.gguf_file(draft_model)
        log_dir = cfg.engine_log_dir or (self.common.data_dir / "logs")
        engine = LlamaServerEngine(
            EngineSettings(
                model_path,
                self._llama_binary(),
                slots=plan.slots,
                context_per_slot=context,
                threads=self._threads(),
                speculation=speculation,
                draft_model_path=draft_path,
                flash_attn=self._flash_attn(spec),
                cache_type_k=cfg.cache_type_k,
                cache_type_v=cfg.cache_type_v,
                slot_save_dir=self._store_dir(),
                batch_tokens=cfg.batch_tokens,
            ),
            port=free_ports(1)[0],
            log_path=Path(log_dir) / f"llama-server-{name}.log",
            url=cfg.small_llama_url if name == ModelTier.SMALL else cfg.large_llama_url,
        )
        self.engines.append(engine)
        await engine.start()
        scheduler = SlotScheduler(
            plan.slots - priority_slots,
            cfg.max_queue,
            engine.erase_slot,
            max_queue_per_tenant=cfg.max_queue_per_tenant,
            priority_slots=priority_slots,
            yield_step_tokens=cfg.yield_step_tokens,
        )
        model_version = store.version(model)
        return Tier(
            name=name,
            model=model,
            model_version=model_version,
            engine=engine,
            scheduler=scheduler,
            speculation=Speculation(speculation, threshold=cfg.speculation_min_acceptance),
            context_window=context,
            on_fall_back=self._fall_back,
            # A draft model's own KV cache is not in a slot's saved state.
            prefix_store=(
                self._prefix_store(model_version, engine.settings)
                if speculation != "draft"
                else None
            ),
        )

    async def _slot_plan(
        self, name: ModelTier, model: str, model_path: Path, context: int
    ) -> tuple[SlotPlan, int]:
        """The tier's slots from its share of the memory budget, and how many of them are
        the priority ones: what memory holds beyond max_num_seqs (a tight budget keeps the
        ordinary ones and none of those)."""
        cfg = self.config
        shape = await asyncio.to_thread(model_shape, model_path)
        try:
            plan = plan_slots(
                shape,
                context_per_seq=context,
                cache_type_k=cfg.cache_type_k,
                cache_type_v=cfg.cache_type_v,
                max_num_seqs=cfg.max_num_seqs + cfg.priority_slots,
                budget=self._memory_budget,
                tiers=2 if cfg.large_model else 1,
            )
        except NotEnoughMemory as error:
            raise FailedPrecondition(f"tier {name} ({model}): {error}") from None
        priority_slots = plan.slots - min(plan.slots, cfg.max_num_seqs)
        log.info(
            "generation.slots",
            tier=name,
            model=model,
            plan=plan.describe(),
            priority_slots=priority_slots,
        )
        return plan, priority_slots

    def _flash_attn(self, spec) -> str:
        cfg = self.config
        if cfg.flash_attn != "model":
            return cfg.flash_attn
        measured = str(spec.extra.get("flash_attn", "auto"))
        if measured == "off" and cfg.cache_type_v != "f16":
            return "auto"  # a quantized V cache cannot run without it
        return measured

    def _store_dir(self) -> Path:
        return self.config.kv_store_dir or (self.common.data_dir / "kv-store")

    def _prefix_store(self, model_version: str, engine: EngineSettings) -> PrefixStore | None:
        cfg = self.config
        if not cfg.kv_store:
            return None
        if self._cache is None:
            self._cache = open_cache(cfg.cache_url)
        # Everything of the engine that changes a saved state's layout or numbers: a state
        # is restored only into an engine that wrote it the same way (the binary's folder
        # names the llama.cpp build and the CPU kernels it was compiled with).
        identity = (
            f"{model_version}|llama.cpp {engine.binary.parent.name}"
            f"|k={engine.cache_type_k}|v={engine.cache_type_v}|fa={engine.flash_attn}"
        )
        settings = StoreSettings(
            directory=self._store_dir(),
            ttl_s=cfg.kv_store_ttl_s,
            max_bytes=cfg.kv_store_max_mb << 20,
            hot_after=cfg.kv_store_hot_after,
            min_tokens=cfg.kv_store_min_tokens,
        )
        return PrefixStore(self._cache, settings, identity)

    def _threads(self) -> int:
        # Every tier's engine reads with all the cores: the large tier runs when the small
        # one's answer failed and nothing else is in flight (the orchestrator's escalation
        # rule), so the two seldom run at once, and cores split between them made every
        # small answer slower (SQuAD c=4 on 2 cores, a large tier served: 0.52 answers/s
        # with one thread each, 0.80 with two; small tier alone 0.85).
        return self.config.threads or usable_cores()

    def _llama_binary(self) -> Path:
        cfg = self.config
        found = resolve_llama_server(
            cfg.llama_server, cfg.llama_cache, self.common.cache_dir, cfg.prebuilt, cfg.engines_dir
        )
        if found is None:  # where a build for this machine would be, for the message
            own = cpu_build(machine_cpu_flags())
            return default_llama_cache(self.common.cache_dir, own) / "llama-server"
        return found.path

    async def ready(self) -> bool:
        self._watch.start()
        if self.config.kv_store:
            self._kv_sweep.start()
        return True

    async def _sweep_kv_store(self) -> None:
        if self._servicer.generator.ready:
            for store in self._servicer.generator.value.prefix_stores():
                await store.sweep_expired()

    async def _watch_engines(self) -> None:
        """Health follows the engines: NOT_SERVING while one cannot serve (named in the
        reason); an engine this service started that exited is started again."""
        if not self._servicer.generator.ready or self.health is None:
            return
        tiers = self._servicer.generator.value.tiers.values()
        problems: dict[ModelTier, str] = {}
        for tier in tiers:
            if isinstance(tier.engine, LlamaServerEngine):
                why = await tier.engine.failure()
                if why is not None:
                    problems[tier.name] = why
        self._engines_down = problems
        if not problems:
            if self._engine_problem:
                self._engine_problem = ""
                await self.health.set_serving(True, reason="engines serving again")
            return
        reason = "; ".join(f"tier {name}: {why}" for name, why in problems.items())
        if reason != self._engine_problem:
            self._engine_problem = reason
            log.error("generation.engine_down", reason=reason)
            await self.health.set_serving(False, reason=reason)
        for tier in tiers:
            engine = tier.engine
            if tier.name in problems and isinstance(engine, LlamaServerEngine) and engine.exited:
                log.warning("generation.engine_restart", tier=tier.name, why=problems[tier.name])
                await self._replace_engine(tier, engine.settings, "restarted")

    async def _replace_engine(self, tier: Tier, settings: EngineSettings, why: str) -> None:
        """A new llama-server for `tier` (new requests queue while running ones finish; the
        new engine's slots start empty), the old one closed."""
        old = tier.engine
        assert isinstance(old, LlamaServerEngine)
        async with tier.scheduler.paused():
            new = LlamaServerEngine(
                settings,
                port=free_ports(1)[0],
                log_path=old.log_path.with_name(f"llama-server-{tier.name}-{why}.log"),
            )
            self.engines.append(new)
            await new.start()
            tier.engine = new
            tier.scheduler.erase = new.erase_slot
            await old.close()
            self.engines.remove(old)

    async def _fall_back(self, tier: Tier) -> None:
        """Restarts a tier's engine without speculation (llama-server fixes it per process).

        New requests queue (with their deadlines) while the running ones finish; then the
        plain engine takes over with empty slots.
        """
        rate = tier.speculation.rate or 0.0
        log.warning(
            "generation.speculation_fallback",
            tier=tier.name,
            acceptance=round(rate, 3),
            threshold=tier.speculation.threshold,
        )
        old = tier.engine
        assert isinstance(old, LlamaServerEngine)  # only llama tiers speculate per process
        if old.external:
            log.warning(
                "generation.speculation_fallback_skipped",
                tier=tier.name,
                reason="the llama-server is external: restart it without speculation",
            )
            return
        await self._replace_engine(
            tier, replace(old.settings, speculation="none", draft_model_path=None), "plain"
        )

    async def _triton_tier(self, name: ModelTier, model: str) -> Tier:
        from ragline_services.generation.triton_engine import TritonGenerationEngine

        cfg = self.config
        engine = TritonGenerationEngine(
            cfg.triton_url,
            model,
            preprocessing_model=cfg.triton_preprocessing_model,
            context_window=cfg.context_per_seq,
            tls=process_tls_for(cfg.triton_tls, "RAGLINE_GENERATION_TRITON_TLS"),
        )
        self.engines.append(engine)
        await engine.start()
        return Tier(
            name=name,
            model=model,
            model_version=f"triton:{model}",
            engine=engine,
            scheduler=SlotScheduler(
                cfg.max_num_seqs,
                cfg.max_queue,
                engine.erase_slot,
                max_queue_per_tenant=cfg.max_queue_per_tenant,
            ),
            speculation=Speculation("none"),  # decided inside the TensorRT-LLM engine
            context_window=cfg.context_per_seq,
        )

    async def start(self) -> None:
        cfg = self.config
        if cfg.engine == "triton":
            tiers = {
                ModelTier.SMALL: await self._triton_tier(ModelTier.SMALL, cfg.triton_small_model)
            }
            if cfg.triton_large_model:
                tiers[ModelTier.LARGE] = await self._triton_tier(
                    ModelTier.LARGE, cfg.triton_large_model
                )
            self._serve(Generator(tiers))
            return
        store = ModelStore(cfg.model_dir or self.common.model_dir)
        _check_models(store, cfg)
        self._memory_budget = (cfg.memory_budget_mb << 20) or int(
            available_memory() * MEMORY_FRACTION
        )
        tiers = {
            ModelTier.SMALL: await self._tier(
                store, ModelTier.SMALL, cfg.small_model, cfg.small_speculation, ""
            )
        }
        if cfg.large_model:
            tiers.update(await self._optional_large_tier(store))
        self._serve(Generator(tiers))

    async def _optional_large_tier(self, store: ModelStore) -> dict[ModelTier, Tier]:
        """The large tier is optional work (the answer step escalates to it only where that
        pays), so a machine that cannot hold or fetch it still answers from the small tier.
        (A mistake in its name stopped the start before: `_check_models`.)"""
        cfg = self.config
        started = len(self.engines)
        try:
            tier = await self._tier(
                store, ModelTier.LARGE, cfg.large_model, cfg.large_speculation, cfg.small_model
            )
        except (ModelError, FailedPrecondition, Unavailable, OSError) as error:
            for engine in self.engines[started:]:
                await engine.close()
            del self.engines[started:]
            log.warning(
                "generation.large_tier_off",
                model=cfg.large_model,
                why=str(error)[:400],
                hint="the small tier serves every answer; RAGLINE_GENERATION_LARGE_MODEL='' "
                "says so without this warning",
            )
            return {}
        return {ModelTier.LARGE: tier}

    def _serve(self, generator: Generator) -> None:
        if self.metrics is not None:
            metrics = self._servicer.metrics = GenerationMetrics(self.metrics)
            metrics.watch(generator, lambda: self._engines_down)
        self._servicer.generator.set(generator)

    async def stop(self) -> None:
        await self._watch.stop()
        await self._kv_sweep.stop()
        if self._servicer.generator.ready:
            await self._servicer.generator.value.finish_saves()
        for engine in self.engines:
            await engine.close()
        if self._cache is not None:
            await self._cache.close()


def _check_models(store: ModelStore, cfg: GenerationConfig) -> None:
    """Each tier's model is one the manifest knows, and a generation (gguf) model: a mistake
    in the settings stops the start before anything is fetched, whichever tier it names."""
    for tier, model in (("SMALL", cfg.small_model), ("LARGE", cfg.large_model)):
        if model and (kind := store.spec(model).kind) != "gguf":
            raise FailedPrecondition(
                f"RAGLINE_GENERATION_{tier}_MODEL names {model}, a {kind} model, not a gguf one"
            )


SPEC = ServiceSpec(
    name="generation",
    grpc_service=generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
    config_factory=GenerationConfig,
    service_factory=GenerationService,
)
