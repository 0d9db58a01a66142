"""The embedding service as a real process on the real model (ONNX Runtime on the CPU)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import urllib.request
import uuid

import grpc
import numpy as np
import pytest

from ragline.clients import open_channel
from ragline.embedder import PASSAGE, input_prefixes
from ragline.models import ModelStore
from ragline.processes import free_ports
from ragline.tokenization import Tokenizer
from ragline.v1 import embedding_pb2, embedding_pb2_grpc
from ragline_app.datasets import load_squad
from ragline_services.embedding.service import EmbeddingConfig
from support import REPO_ROOT, SQUAD_SAMPLE, field_violations, wait_until
from support.metrics import sample_values, scrape

pytestmark = pytest.mark.integration

DEFAULT_MODEL = EmbeddingConfig.model_fields["model"].default
PASSAGE_PREFIX = input_prefixes(ModelStore().spec(DEFAULT_MODEL).extra).get(PASSAGE, "")
MAX_TOKENS = ModelStore().spec(DEFAULT_MODEL).max_tokens


def model_token_counts(texts: list[str]) -> list[int]:
    """Tokens of each text as the default model's tokenizer counts them."""
    spec = ModelStore().spec(DEFAULT_MODEL)
    tokenizer = Tokenizer(ModelStore().file(spec.tokenizer, "tokenizer.json"), spec.max_tokens)
    return [t.length for t in tokenizer.encode(texts, refuse_over_limit=False)]


def sample_texts(n: int) -> list[str]:
    passages, questions = load_squad(SQUAD_SAMPLE)
    texts = []
    for i in range(n):
        texts.append(questions[i].text if i % 2 else passages[i].text[: 80 + 40 * (i % 7)])
    return texts


OPERATOR = (("x-ragline-tenant", "ops"), ("x-ragline-operator", "true"))
LATE_TENANT = (("x-ragline-tenant", "late"), ("x-ragline-operator", "true"))


async def embed(
    address: str, request: embedding_pb2.EmbedRequest, deadline_s=30.0, metadata=OPERATOR
):
    async with grpc.aio.insecure_channel(address) as channel:
        return await embedding_pb2_grpc.EmbeddingServiceStub(channel).Embed(
            request, timeout=deadline_s, metadata=metadata
        )


def as_array(reply) -> np.ndarray:
    return np.array([list(e.values) for e in reply.embeddings], dtype=np.float32)


async def test_embeds_with_usage_version_and_timing(embedding_service):
    reply = await embed(
        embedding_service.address, embedding_pb2.EmbedRequest(texts=["hello world", "a b"])
    )
    vectors = as_array(reply)
    assert vectors.shape == (2, 384) and reply.dim == 384
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # what the model read: the text after the model's passage prefix, with its own tokenizer
    counts = model_token_counts([f"{PASSAGE_PREFIX}hello world", f"{PASSAGE_PREFIX}a b"])
    assert [e.token_count for e in reply.embeddings] == counts
    assert reply.usage.input_tokens == sum(counts)
    assert reply.model == DEFAULT_MODEL
    assert reply.model_version.startswith(f"{DEFAULT_MODEL}@")
    stages = [s.name for s in reply.timing.stages]
    assert stages == ["tokenize", "inference"]
    assert reply.timing.total.ToNanoseconds() >= reply.timing.compute.ToNanoseconds() > 0


async def test_semantics_question_is_nearest_to_its_passage(embedding_pair):
    batched, _ = embedding_pair
    passages, questions = load_squad(SQUAD_SAMPLE)
    chosen = passages[:10]
    by_id = {p.id: i for i, p in enumerate(chosen)}
    qs = [q for q in questions if q.passage_id in by_id][:20]
    p_vecs = as_array(
        await embed(batched.address, embedding_pb2.EmbedRequest(texts=[p.text for p in chosen]))
    )
    q_vecs = as_array(
        await embed(
            batched.address,
            embedding_pb2.EmbedRequest(
                texts=[q.text for q in qs], input_type=embedding_pb2.INPUT_TYPE_QUERY
            ),
        )
    )
    hits = np.argmax(q_vecs @ p_vecs.T, axis=1)
    accuracy = np.mean([hits[i] == by_id[q.passage_id] for i, q in enumerate(qs)])
    assert accuracy >= 0.7, accuracy


async def test_batched_and_unbatched_results_are_identical(embedding_pair):
    batched, unbatched = embedding_pair
    texts = sample_texts(24)

    async def one_by_one(address):
        replies = await asyncio.gather(
            *(embed(address, embedding_pb2.EmbedRequest(texts=[t])) for t in texts)
        )
        return replies, np.concatenate([as_array(r) for r in replies])

    batched_replies, together = await one_by_one(batched.address)
    unbatched_replies, alone = await one_by_one(unbatched.address)
    assert max(r.batch_size for r in batched_replies) > 1, "nothing was batched"
    assert {r.batch_size for r in unbatched_replies} == {1}
    # A tenant is shown its own texts only: the batch size would show others' traffic.
    tenant_view = await asyncio.gather(
        *(
            embed(
                batched.address,
                embedding_pb2.EmbedRequest(texts=[t]),
                metadata=(("x-ragline-tenant", "acme"),),
            )
            for t in texts
        )
    )
    assert {r.batch_size for r in tenant_view} == {1}
    assert np.abs(together - alone).max() < 1e-6


async def test_a_model_that_is_not_batch_invariant_runs_every_text_alone(embedding_service):
    """The default graph quantizes activations with scales taken from its whole run, so a
    text run beside others would get another vector (cosine ~0.986): the service runs it
    one text at a time, whatever the traffic, and a text's vector is the same in any call."""
    from ragline.models import ModelStore

    assert ModelStore().spec(DEFAULT_MODEL).extra.get("batch_invariant") is False
    texts = sample_texts(16)
    together = await embed(embedding_service.address, embedding_pb2.EmbedRequest(texts=texts))
    alone = await asyncio.gather(
        *(embed(embedding_service.address, embedding_pb2.EmbedRequest(texts=[t])) for t in texts)
    )
    assert {r.batch_size for r in alone} == {1}  # concurrent calls never share a run
    np.testing.assert_array_equal(as_array(together), np.concatenate([as_array(r) for r in alone]))


async def test_dimension_truncation_renormalises(embedding_pair):
    batched, _ = embedding_pair
    full = as_array(await embed(batched.address, embedding_pb2.EmbedRequest(texts=["Warsaw"])))
    cut = await embed(batched.address, embedding_pb2.EmbedRequest(texts=["Warsaw"], dim=128))
    vector = as_array(cut)[0]
    assert cut.dim == 128 and vector.shape == (128,)
    assert np.isclose(np.linalg.norm(vector), 1.0, atol=1e-5)
    expected = full[0, :128] / np.linalg.norm(full[0, :128])
    assert np.allclose(vector, expected, atol=1e-6)


async def test_over_long_text_is_truncated_or_refused(embedding_pair):
    batched, _ = embedding_pair
    long_text = " ".join(["word"] * 400)
    reply = await embed(batched.address, embedding_pb2.EmbedRequest(texts=["short", long_text]))
    assert [e.truncated for e in reply.embeddings] == [False, True]
    assert reply.embeddings[1].token_count == 256
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await embed(
            batched.address,
            embedding_pb2.EmbedRequest(
                texts=["short", long_text], truncation=embedding_pb2.TRUNCATION_NONE
            ),
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("texts[1]: is longer than the model's 256-token")


@pytest.mark.parametrize(
    "request_fields,field",
    [
        ({}, "texts"),
        ({"texts": ["ok", ""]}, "texts[1]"),
        ({"texts": ["x"] * 257}, "texts"),
        ({"texts": ["x" * 40000]}, "texts[0]"),
        ({"texts": ["ok"], "dim": 385}, "dim"),
        ({"texts": ["ok"], "dim": 9000}, "dim"),
        ({"texts": ["ok"], "input_type": 9}, "input_type"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(
    embedding_pair, request_fields, field
):
    batched, _ = embedding_pair
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await embed(batched.address, embedding_pb2.EmbedRequest(**request_fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert next(iter(field_violations(caught.value))) == field


def texts_run(handle) -> float:
    """Texts the service's model has run so far (its batcher's histogram)."""
    return sum(sample_values(scrape(handle.metrics_port), "ragline_batch_texts", "_sum").values())


async def test_a_deadline_that_passes_in_the_queue_is_refused_before_compute(embedding_pair):
    batched, _ = embedding_pair

    async def gauge(name: str) -> float:
        found = await asyncio.to_thread(scrape, batched.metrics_port)
        return sum(sample_values(found, name).values())

    before = texts_run(batched)
    run = uuid.uuid4().hex  # texts no cache of the service has seen
    runners = int(await gauge("ragline_batch_runners"))
    # A long request for each runner: a request behind them waits for one to be free.
    ahead = [[f"text {n} of long request {r} {run}" for n in range(256)] for r in range(runners)]
    running = [
        asyncio.create_task(embed(batched.address, embedding_pb2.EmbedRequest(texts=texts)))
        for texts in ahead
    ]

    async def all_runners_busy() -> bool:
        return await gauge("ragline_batch_runs_in_flight") >= runners

    assert await wait_until(all_runners_busy), "the long requests' model runs never began"
    late = [f"text {n} of a request that waits too long {run}" for n in range(200)]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        # another tenant's (a queue of its own), waiting for a runner to be free
        await embed(
            batched.address,
            embedding_pb2.EmbedRequest(texts=late),
            deadline_s=0.5,
            metadata=LATE_TENANT,
        )
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.gather(*running)
    # Refused by the service, not only by the client's timer: none of the 200 texts that
    # waited for the long runs reached the model. A request of the same tenant behind them
    # (FIFO) has run once its answer is here.
    probe = embedding_pb2.EmbedRequest(texts=[f"a probe {run}"])
    await embed(batched.address, probe, metadata=LATE_TENANT)
    assert texts_run(batched) - before == sum(map(len, ahead)) + 1


def test_full_queue_answers_resource_exhausted_quickly(launcher):
    handle = launcher.start(
        "embedding",
        env={"RAGLINE_EMBEDDING_MAX_QUEUE_TEXTS": "64", "RAGLINE_EMBEDDING_MAX_BATCH_TEXTS": "8"},
    )

    async def flood():
        async with grpc.aio.insecure_channel(handle.address) as channel:
            stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
            texts = sample_texts(32)
            calls = [
                stub.Embed(embedding_pb2.EmbedRequest(texts=texts), timeout=60) for _ in range(12)
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(flood())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert refused and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert "queue is full" in refused[0].details()
    assert any(not isinstance(r, Exception) for r in results)


@pytest.mark.full
def test_export_matches_torch(tmp_path):
    """tools/export_onnx.py: fp32 ONNX equals the torch model (the tool fails below 0.999)."""
    pytest.importorskip("torch", reason="the export extra is not installed")
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tools" / "export_onnx.py"),
            "--model-dir",
            str(tmp_path),
            "--passages",
            "16",
            "--questions",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "minilm-l6-fp32" / "export.json").read_text())["report"]
    assert report["cosine_min"] >= 0.999 and report["top1_agreement"] == 1.0
    int8 = json.loads((tmp_path / "minilm-l6-int8" / "export.json").read_text())["report"]
    assert int8["cosine_min"] >= 0.95


def test_triton_path_equals_the_onnx_runtime_path(triton, launcher):
    """The service's Triton backend against the real tritonserver 2.51 (python backend)."""
    assert triton.metadata()["version"] == "2.51.0"
    via_triton = launcher.start(
        "embedding",
        env={
            "RAGLINE_EMBEDDING_BACKEND": "triton",
            "RAGLINE_EMBEDDING_TRITON_URL": triton.grpc_url,
            "RAGLINE_EMBEDDING_TRITON_MODEL": "minilm_l6",
        },
    )
    via_ort = launcher.start("embedding")
    texts = [*sample_texts(20), " ".join(["long"] * (MAX_TOKENS + 40))]

    async def both():
        request = embedding_pb2.EmbedRequest(texts=texts)
        return await asyncio.gather(
            embed(via_triton.address, request), embed(via_ort.address, request)
        )

    triton_reply, ort_reply = asyncio.run(both())
    a, b = as_array(triton_reply), as_array(ort_reply)
    cosine = np.sum(a * b, axis=1)
    assert cosine.min() > 0.999, cosine.min()
    assert triton_reply.model_version == ort_reply.model_version
    assert [e.truncated for e in triton_reply.embeddings][-1] is True


def test_triton_backend_down_is_not_serving(launcher, tmp_path):
    port = free_ports(1)[0]
    handle = launcher.start(
        "embedding",
        wait=False,
        env={
            "RAGLINE_EMBEDDING_BACKEND": "triton",
            "RAGLINE_EMBEDDING_TRITON_URL": f"127.0.0.1:{port}",
        },
    )
    assert handle.process.wait(timeout=60) == 1
    assert "Triton at 127.0.0.1" in handle.log()
    launcher.forget(handle)


async def test_a_flooding_tenant_neither_fills_the_queue_nor_starves_another(launcher):
    service = launcher.start(
        "embedding",
        env={
            "RAGLINE_EMBEDDING_MAX_BATCH_TEXTS": "8",
            "RAGLINE_EMBEDDING_MAX_QUEUE_TEXTS": "64",
            "RAGLINE_EMBEDDING_MAX_QUEUE_TEXTS_PER_TENANT": "32",
        },
    )
    long_text = "The Vistula flows through Warsaw and Krakow to the Baltic Sea. " * 20

    async def embed(stub, tenant, count):
        reply = await stub.Embed(
            embedding_pb2.EmbedRequest(texts=[long_text] * count),
            timeout=60,
            metadata=(("x-ragline-tenant", tenant),),
        )
        return reply.timing.queue_wait.ToNanoseconds() / 1e9

    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        await embed(stub, "warm", 8)
        # 64 texts at once: more than the tenant's share (32) can wait, even with a batch
        # of 8 running on each of two cores.
        flood = [asyncio.create_task(embed(stub, "noisy", 8)) for _ in range(8)]
        await asyncio.sleep(0.05)
        quiet_wait = await embed(stub, "quiet", 8)  # room was left, and its turn comes
        outcomes = await asyncio.gather(*flood, return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    noisy_waits = [o for o in outcomes if isinstance(o, float)]
    assert refused and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
    assert all("this tenant" in e.details() for e in refused)
    # The quiet tenant waited about one noisy batch, not the whole flood.
    assert quiet_wait < max(noisy_waits) * 0.75, (quiet_wait, noisy_waits)


async def test_a_query_runs_before_the_same_tenants_bulk_backlog(launcher):
    service = launcher.start(
        "embedding",
        env={"RAGLINE_EMBEDDING_MAX_BATCH_TEXTS": "8", "RAGLINE_EMBEDDING_PARALLEL_RUNS": "1"},
    )
    long_text = "The Vistula flows through Warsaw and Krakow to the Baltic Sea. " * 20
    metadata = (("x-ragline-tenant", "ann"), ("x-ragline-operator", "true"))

    async def embed(stub, texts, priority):
        reply = await stub.Embed(
            embedding_pb2.EmbedRequest(texts=texts, priority=priority),
            timeout=120,
            metadata=metadata,
        )
        return reply.timing.queue_wait.ToNanoseconds() / 1e9, reply.batch_size

    async with grpc.aio.insecure_channel(service.address) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        await embed(stub, ["warm up"], embedding_pb2.PRIORITY_INTERACTIVE)
        backlog = [
            asyncio.create_task(embed(stub, [long_text] * 8, embedding_pb2.PRIORITY_BULK))
            for _ in range(6)
        ]
        await asyncio.sleep(0.05)
        query_wait, query_batch = await embed(
            stub, ["Which river flows through Warsaw?"], embedding_pb2.PRIORITY_UNSPECIFIED
        )
        bulk = await asyncio.gather(*backlog)
    bulk_waits = sorted(wait for wait, _ in bulk)
    # It waited for the run in progress at most, not for the five bulk requests behind it,
    # and ran alone (never padded with the passages).
    assert query_wait < bulk_waits[-1] * 0.5, (query_wait, bulk_waits)
    assert query_batch == 1


def test_the_triton_path_under_mutual_tls(launcher, triton_starter, tmp_path):
    """A real tritonserver serving gRPC under mutual TLS: the embedding service reaches it
    with its own certificate (RAGLINE_EMBEDDING_TRITON_TLS), and not without one."""
    from ragline_app.certificates import local_authority

    pki = local_authority(tmp_path / "pki")
    model = EmbeddingConfig.model_fields["model"].default
    server = triton_starter(
        REPO_ROOT / "deploy" / "triton" / "embedding" / "cpu",
        tmp_path / "triton",
        {"minilm_l6/1/model.onnx": ModelStore().file(model, "model.onnx")},
        certificates=pki,
    )
    try:
        env = {
            "RAGLINE_EMBEDDING_BACKEND": "triton",
            "RAGLINE_EMBEDDING_TRITON_URL": f"localhost:{server.grpc_port}",
            "RAGLINE_EMBEDDING_TRITON_MODEL": "minilm_l6",
            "RAGLINE_EMBEDDING_TRITON_TLS": "true",
            **pki.service_environment("mtls"),
        }
        service = launcher.start("embedding", env=env)

        async def embed_under_tls():
            # the service serves under the same RAGLINE_TLS_* it reaches Triton with
            async with open_channel(service.address, service.tls) as channel:
                return await embedding_pb2_grpc.EmbeddingServiceStub(channel).Embed(
                    embedding_pb2.EmbedRequest(texts=["The Vistula"]), timeout=30
                )

        reply = asyncio.run(embed_under_tls())
        assert len(as_array(reply)[0]) == 384
        launcher.stop_all()
        plain = {k: v for k, v in env.items() if k != "RAGLINE_EMBEDDING_TRITON_TLS"}
        refused = launcher.start("embedding", env=plain, wait=False)
        assert refused.process.wait(timeout=60) == 1
        launcher.forget(refused)
        assert "Triton at localhost" in refused.log()
    finally:
        server.stop()


def test_a_triton_model_that_declares_its_version_labels_the_vectors_and_batches(
    launcher, triton_starter, tmp_path
):
    """The version a Triton model declares (ragline_model_version: a TensorRT engine is not
    the manifest's file) is the one the vectors carry, and a batch-invariant declaration
    lets the service send whole batches (Triton counts fewer runs than texts)."""
    source = tmp_path / "repository"
    shutil.copytree(REPO_ROOT / "deploy" / "triton" / "embedding" / "cpu", source)
    config = source / "minilm_l6" / "config.pbtxt"
    config.write_text(
        config.read_text()
        + 'parameters { key: "ragline_model_version" value: { string_value: "test-engine@1" } }\n'
        + 'parameters { key: "ragline_batch_invariant" value: { string_value: "true" } }\n'
    )
    model = EmbeddingConfig.model_fields["model"].default
    server = triton_starter(
        source,
        tmp_path / "triton",
        {"minilm_l6/1/model.onnx": ModelStore().file(model, "model.onnx")},
    )
    try:
        service = launcher.start(
            "embedding",
            env={
                "RAGLINE_EMBEDDING_BACKEND": "triton",
                "RAGLINE_EMBEDDING_TRITON_URL": server.grpc_url,
                "RAGLINE_EMBEDDING_MAX_WAIT_MS": "50",
            },
        )
        texts = sample_texts(16)
        reply = asyncio.run(embed(service.address, embedding_pb2.EmbedRequest(texts=texts)))
        assert reply.model_version == "test-engine@1"
        statistics = json.loads(
            urllib.request.urlopen(
                f"http://127.0.0.1:{server.http_port}/v2/models/minilm_l6/stats", timeout=5
            ).read()
        )["model_stats"][0]
        assert statistics["inference_count"] >= 16
        assert statistics["execution_count"] < statistics["inference_count"]
    finally:
        server.stop()
