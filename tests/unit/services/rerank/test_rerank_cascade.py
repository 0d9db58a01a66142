"""The cascade's rules with stand-in models (the real models: tests/integration/.../rerank)."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np
import pytest

from ragline import deadlines
from ragline.batching import MicroBatcher
from ragline.errors import DeadlineExceeded, InvalidArgument
from ragline.tokenization import TokenizedText
from ragline.vocabulary import SkipCause
from ragline_services.rerank.cascade import (
    CROSS_ENCODER,
    LATE_INTERACTION,
    Candidate,
    QueryCache,
    Reranker,
    RerankInput,
    TokenCache,
)
from ragline_services.rerank.models import EncodedText, maxsim_many, projection, quantize
from ragline_services.rerank.service import skipped_query_tokens
from ragline_services.rerank.token_store import TokenStore


def word_id(word: str) -> int:
    return zlib.crc32(word.lower().strip(".,?").encode()) % 1000 + 1


class WordTokenizer:
    """One token per word; pairs as first words, then second words (type ids 0 / 1)."""

    def encode(self, texts, *, refuse_over_limit=False):
        return [
            TokenizedText(np.array([0, *(word_id(w) for w in t.split()), 0]), False) for t in texts
        ]

    def encode_pairs(self, pairs):
        out = []
        for first, second in pairs:
            a = [word_id(w) for w in first.split()]
            b = [word_id(w) for w in second.split()]
            out.append(TokenizedText(np.array(a + b), False, np.array([0] * len(a) + [1] * len(b))))
        return out


class Models:
    """Token vectors: one axis per word (so MaxSim counts shared words); cross-encoder: the
    number of query words in the passage, plus a bonus for the word 'gold'."""

    def __init__(self, delay_s: float = 0.0, token_delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.token_delay_s = token_delay_s
        self.token_texts = 0
        self.pairs = 0
        self.fail_tokens = False

    async def tokens(self, texts):
        if self.fail_tokens:
            raise RuntimeError("the token model failed")
        if self.token_delay_s:
            await asyncio.sleep(self.token_delay_s)
        self.token_texts += len(texts)
        out = []
        for text in texts:
            vectors = np.zeros((max(text.length - 2, 1), 1001), dtype=np.float32)
            for row, token in enumerate(text.ids[1:-1]):
                vectors[row, token] = 1.0
            mean = vectors.mean(axis=0)
            out.append(EncodedText(vectors, mean / max(np.linalg.norm(mean), 1e-12)))
        return out

    async def cross(self, pairs):
        self.pairs += len(pairs)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        scores = []
        for pair in pairs:
            query = set(pair.ids[pair.type_ids == 0].tolist())
            passage = pair.ids[pair.type_ids == 1].tolist()
            scores.append(len(query & set(passage)) + 5 * (word_id("gold") in passage))
        return np.array(scores, dtype=np.float32)


async def make(models: Models, **options) -> Reranker:
    token_batcher = MicroBatcher(models.tokens, max_batch_texts=64, max_wait_s=0)
    pair_batcher = MicroBatcher(models.cross, max_batch_texts=64, max_wait_s=0)
    await token_batcher.start()
    await pair_batcher.start()
    return Reranker(
        token_tokenizer=WordTokenizer(),
        token_batcher=token_batcher,
        pair_tokenizer=WordTokenizer(),
        pair_batcher=pair_batcher,
        cache=TokenCache(10_000_000),
        **options,
    )


CANDIDATES = [
    Candidate("far", "nothing in common here", 9.0),
    Candidate("near", "warsaw river city", 1.0),
    Candidate("gold", "the vistula river flows through warsaw gold", 0.5),
    Candidate("half", "warsaw is a city", 2.0),
]


async def test_stage_one_cuts_to_late_interaction_k_and_stage_two_orders_the_rest():
    models = Models()
    reranker = await make(models, late_interaction_weight=1.0, cross_encoder_candidates=2)
    out = await reranker.rerank(
        RerankInput(
            "acme", "which river flows through warsaw", CANDIDATES, top_k=2, late_interaction_k=3
        )
    )
    assert out.stages_run == [LATE_INTERACTION, CROSS_ENCODER] and not out.skipped
    assert [r.id for r in out.results] == ["gold", "near"]
    assert set(out.results[0].scores) == {LATE_INTERACTION, CROSS_ENCODER}
    assert models.pairs == 2  # only the best two survivors of stage 1 were read together
    assert out.input_tokens > 0


async def test_the_incoming_score_counts_in_stage_one():
    reranker = await make(Models(), late_interaction_weight=0.0)
    out = await reranker.rerank(
        RerankInput("acme", "river", CANDIDATES, top_k=4, late_interaction_k=1, allow_skip=True)
    )
    assert out.results[0].id == "far"  # by its first-stage score alone


async def test_stage_two_is_skipped_when_the_deadline_cannot_afford_it_and_the_request_allows():
    models = Models(delay_s=0.6)
    reranker = await make(models)
    question = RerankInput("acme", "river warsaw", CANDIDATES, top_k=2, allow_skip=True)
    await reranker.rerank(question)  # learns what stage 2 costs
    models.pairs = 0
    with deadlines.deadline_scope(0.2):
        out = await reranker.rerank(question)
    assert out.stages_run == [LATE_INTERACTION]
    assert out.skipped and out.skipped[0].stage == CROSS_ENCODER
    assert out.skipped[0].cause == SkipCause.DEADLINE
    assert out.skipped[0].reason.startswith("deadline")
    assert models.pairs == 0 and len(out.results) == 2
    with deadlines.deadline_scope(0.2), pytest.raises(DeadlineExceeded, match="allow_skip"):
        await reranker.rerank(
            RerankInput("acme", "river warsaw", CANDIDATES, top_k=2, allow_skip=False)
        )


async def test_candidate_token_vectors_are_computed_once_per_tenant():
    models = Models()
    reranker = await make(models)
    await reranker.rerank(RerankInput("acme", "river", CANDIDATES))
    assert models.token_texts == 1 + len(CANDIDATES)
    await reranker.rerank(RerankInput("acme", "warsaw", CANDIDATES))
    assert models.token_texts == 1 + len(CANDIDATES) + 1  # only the new query
    await reranker.rerank(RerankInput("globex", "warsaw", CANDIDATES))
    assert models.token_texts == 2 * (1 + len(CANDIDATES)) + 1  # never another tenant's


async def test_prepared_documents_are_not_encoded_again_by_a_query():
    models = Models()
    reranker = await make(models)
    prepared = await reranker.prepare("acme", CANDIDATES)
    assert (prepared.prepared, prepared.already_prepared) == (len(CANDIDATES), 0)
    again = await reranker.prepare("acme", CANDIDATES[:2])
    assert (again.prepared, again.already_prepared) == (0, 2)
    models.token_texts = 0
    await reranker.rerank(RerankInput("acme", "river", CANDIDATES))
    assert models.token_texts == 1  # the query only
    await reranker.rerank(RerankInput("globex", "river", CANDIDATES))
    assert models.token_texts == 2 + len(CANDIDATES)  # another tenant prepared nothing


async def test_prepare_with_embeddings_returns_the_run_s_embedding_of_every_document():
    models = Models()
    reranker = await make(models, embedding_model_version="m@1")
    await reranker.prepare("acme", CANDIDATES[:2])  # kept: encoded again all the same
    models.token_texts = 0
    prepared = await reranker.prepare("acme", CANDIDATES, embeddings=True)
    assert models.token_texts == len(CANDIDATES)
    assert (prepared.prepared, prepared.already_prepared) == (len(CANDIDATES), 0)
    expected = await models.tokens(WordTokenizer().encode([c.text for c in CANDIDATES]))
    assert len(prepared.embeddings) == len(CANDIDATES)
    for got, want, candidate in zip(prepared.embeddings, expected, CANDIDATES, strict=True):
        np.testing.assert_array_equal(got.vector, want.embedding)
        assert got.token_count == len(candidate.text.split()) + 2
    # The token vectors of that run are kept: a rerank encodes only its query.
    models.token_texts = 0
    await reranker.rerank(RerankInput("acme", "river", CANDIDATES))
    assert models.token_texts == 1
    # Without embeddings asked, none are returned (and kept documents are not re-encoded).
    assert (await reranker.prepare("acme", CANDIDATES)).embeddings == []


async def test_a_model_trained_with_prefixes_reads_texts_with_them_and_matches_without():
    """multilingual-e5 reads "query: ..." and "passage: ...": texts are run so, so that a
    passage's run is also its embedding (one model run per passage at ingest), and the
    prefix's own token vectors are left out of MaxSim (every passage has them)."""
    models = Models()
    reranker = await make(models, query_prefix="query: ", passage_prefix="passage: ")
    prepared = await reranker.prepare("acme", CANDIDATES, "river warsaw", embeddings=True)
    expected = await models.tokens(
        WordTokenizer().encode(["passage: " + c.text for c in CANDIDATES])
    )
    for got, want in zip(prepared.embeddings, expected, strict=True):
        np.testing.assert_array_equal(got.vector, want.embedding)
    for candidate in CANDIDATES:
        kept = reranker.cache.get(TokenCache.key("acme", candidate))
        assert len(kept) == len(candidate.text.split())  # the passage's words alone
        assert not kept[:, word_id("passage:")].any()
    query = await reranker.queries.get(QueryCache.key("acme", "river warsaw"))
    assert len(query.rows) == 2 and not query.rows[:, word_id("query:")].any()


QUESTION = "which river flows through warsaw"


async def test_a_prepared_query_is_not_encoded_again_and_ranks_the_same():
    models = Models()
    reranker = await make(models)
    await reranker.prepare("acme", CANDIDATES)
    unprepared = await reranker.rerank(RerankInput("acme", QUESTION, CANDIDATES, top_k=4))
    prepared = await reranker.prepare("acme", [], QUESTION)
    assert prepared.query_prepared and not prepared.query_already_prepared
    assert prepared.input_tokens == len(QUESTION.split()) + 2
    again = await reranker.prepare("acme", [], QUESTION)
    assert again.query_already_prepared and again.input_tokens == 0
    models.token_texts = 0
    out = await reranker.rerank(RerankInput("acme", QUESTION, CANDIDATES, top_k=4))
    assert models.token_texts == 0  # the query was ready, the candidates kept
    assert out.input_tokens == unprepared.input_tokens - prepared.input_tokens
    assert [(r.id, r.scores) for r in out.results] == [(r.id, r.scores) for r in unprepared.results]


async def test_another_tenants_prepared_query_is_never_used():
    models = Models()
    reranker = await make(models)
    await reranker.prepare("acme", CANDIDATES, QUESTION)
    models.token_texts = 0
    await reranker.rerank(RerankInput("globex", QUESTION, CANDIDATES))
    assert models.token_texts == 1 + len(CANDIDATES)


async def test_a_rerank_waits_for_its_query_still_being_encoded_instead_of_encoding_it_again():
    models = Models(token_delay_s=0.2)
    reranker = await make(models)
    await reranker.prepare("acme", CANDIDATES)
    models.token_texts = 0
    preparing = asyncio.create_task(reranker.prepare("acme", [], QUESTION))
    await asyncio.sleep(0.05)  # the query's encoding is under way
    preparing.cancel()  # the caller that started it goes away; the encoding goes on
    out = await reranker.rerank(RerankInput("acme", QUESTION, CANDIDATES, top_k=2))
    assert models.token_texts == 1  # encoded once, for both
    assert out.results[0].id == "gold"
    with pytest.raises(asyncio.CancelledError):
        await preparing


async def test_a_failed_preparation_leaves_the_rerank_to_encode_its_query():
    models = Models()
    reranker = await make(models)
    await reranker.prepare("acme", CANDIDATES)
    models.fail_tokens = True
    failed = await reranker.prepare("acme", [], QUESTION)
    assert not failed.query_prepared
    models.fail_tokens = False
    models.token_texts = 0
    out = await reranker.rerank(RerankInput("acme", QUESTION, CANDIDATES, top_k=2))
    assert models.token_texts == 1 and out.results[0].id == "gold"


async def test_a_prepared_query_expires():
    models = Models()
    reranker = await make(models, queries=QueryCache(ttl_s=0.05))
    await reranker.prepare("acme", CANDIDATES, QUESTION)
    await asyncio.sleep(0.1)
    models.token_texts = 0
    await reranker.rerank(RerankInput("acme", QUESTION, CANDIDATES))
    assert models.token_texts == 1


async def test_a_prepare_with_neither_documents_nor_query_is_refused_naming_the_field():
    reranker = await make(Models())
    with pytest.raises(InvalidArgument) as caught:
        await reranker.prepare("acme", [], "")
    assert caught.value.field == "documents"


async def test_a_cache_smaller_than_one_request_still_ranks_like_a_large_one():
    small = await make(Models())
    small.cache = TokenCache(max_bytes=1)  # every entry evicted as soon as it is kept
    large = await make(Models())
    question = RerankInput("acme", "which river flows through warsaw", CANDIDATES, top_k=4)
    assert [r.id for r in (await small.rerank(question)).results] == [
        r.id for r in (await large.rerank(question)).results
    ]


async def test_duplicate_candidate_ids_are_refused_naming_the_field():
    reranker = await make(Models())
    with pytest.raises(InvalidArgument) as caught:
        await reranker.rerank(RerankInput("acme", "q", [CANDIDATES[0], CANDIDATES[0]]))
    assert caught.value.field == "candidates[1].id"


def test_the_cache_stores_int8_and_evicts_the_least_recently_used():
    cache = TokenCache(max_bytes=2 * (16 * 8 + 16 * 4))
    keys = [TokenCache.key("t", Candidate(str(i), f"text {i}")) for i in range(3)]
    rng = np.random.default_rng(1)
    vectors = [rng.normal(size=(16, 8)).astype(np.float32) for _ in keys]
    for key, v in zip(keys, vectors, strict=True):
        cache.put(key, v)
    assert cache.get(keys[0]) is None  # evicted
    restored = cache.get(keys[2])
    assert np.abs(restored - vectors[2]).max() < np.abs(vectors[2]).max() / 100


def test_token_vectors_are_stored_reduced():
    basis = projection(384, 128)
    assert np.allclose(basis.T @ basis, np.eye(128), atol=1e-5)
    rows, scales = quantize(np.ones((3, 128), dtype=np.float32))
    assert rows.dtype == np.int8 and scales.shape == (3,)


async def test_late_interaction_only_runs_stage_one_and_reports_nothing_skipped():
    models = Models()
    reranker = await make(models)
    out = await reranker.rerank(
        RerankInput("acme", "river warsaw", CANDIDATES, top_k=2, late_interaction_only=True)
    )
    assert out.stages_run == [LATE_INTERACTION] and not out.skipped
    assert models.pairs == 0 and len(out.results) == 2


def test_maxsim_over_many_documents_equals_one_document_at_a_time():
    rng = np.random.default_rng(3)
    query = rng.normal(size=(7, 16)).astype(np.float32)
    documents = [rng.normal(size=(n, 16)).astype(np.float32) for n in (1, 30, 0, 5, 112)]
    together = maxsim_many(query, documents)
    # MaxSim's definition, one document at a time.
    alone = [(query @ d.T).max(axis=1).mean() if len(d) else 0.0 for d in documents]
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-6)
    assert together[2] == 0.0  # a document without tokens matches nothing
    assert not maxsim_many(query[:0], documents).any()


async def test_late_interaction_leaves_the_skipped_query_tokens_out():
    # "the the river": counting "the", the passage of "the"s matches 2 of 3 query tokens and
    # wins; without it only "river" counts and the river passage wins.
    candidates = [Candidate("stop", "the the the"), Candidate("river", "river banks")]
    request = RerankInput("acme", "the the river", candidates, top_k=2, late_interaction_only=True)
    counted = await make(Models(), late_interaction_weight=1.0)
    skipping = await make(
        Models(), late_interaction_weight=1.0, skip_query_tokens=frozenset({word_id("the")})
    )
    assert [r.id for r in (await counted.rerank(request)).results] == ["stop", "river"]
    assert [r.id for r in (await skipping.rerank(request)).results] == ["river", "stop"]
    # A query of skipped tokens only is scored on all of them.
    only = RerankInput("acme", "the", candidates, top_k=2, late_interaction_only=True)
    assert (await skipping.rerank(only)).results[0].id == "stop"


def test_the_skipped_query_tokens_are_stop_words_and_punctuation():
    class Vocabulary:
        def vocabulary(self):
            return {"the": 1, "river": 2, "?": 3, "[CLS]": 4, "##s": 5, "what": 6, "1990": 7}

    assert skipped_query_tokens(Vocabulary()) == {1, 3, 6}


async def test_a_restarted_reranker_reads_prepared_vectors_from_disk(tmp_path):
    store = TokenStore(tmp_path / "tokens-a.sqlite", max_bytes=1 << 24)
    await store.open()
    first = await make(Models(), store=store)
    assert (await first.prepare("acme", CANDIDATES)).prepared == len(CANDIDATES)
    question = RerankInput("acme", "which river flows through warsaw", CANDIDATES, top_k=4)
    before = await first.rerank(question)
    models = Models()
    restarted = await make(models, store=store)  # a new process: its memory cache empty
    again = await restarted.prepare("acme", CANDIDATES)
    assert (again.prepared, again.already_prepared) == (0, len(CANDIDATES))
    after = await restarted.rerank(question)
    assert models.token_texts == 1  # the query alone
    assert [(r.id, r.scores) for r in after.results] == [(r.id, r.scores) for r in before.results]
    fresh = Candidate("new", "a passage nobody prepared", 0.0)
    await restarted.rerank(RerankInput("acme", "passage", [fresh]))
    await restarted.flush()  # what a rerank encoded reaches the disk behind its answer
    assert await store.get_many([TokenCache.key("acme", fresh)])
    store.close()


async def test_a_question_the_models_do_not_read_keeps_the_order_it_came_in():
    """English models (scripts = ["Latin"]) do not score a Chinese question: measured on the
    Chinese set, they lowered hybrid nDCG@10 from 0.797 to 0.743. The candidates keep their
    first-stage order, each stage reported skipped for the language, and no model runs."""
    models = Models()
    reranker = await make(
        models, token_scripts=frozenset({"Latin"}), pair_scripts=frozenset({"Latin"})
    )
    out = await reranker.rerank(RerankInput("acme", "哪条河流经华沙", CANDIDATES, top_k=3))
    assert [r.id for r in out.results] == ["far", "near", "gold"]
    assert [skip.stage for skip in out.skipped] == [LATE_INTERACTION, CROSS_ENCODER]
    assert all(skip.cause == SkipCause.LANGUAGE for skip in out.skipped)
    assert all(skip.reason.startswith("language:") for skip in out.skipped)
    assert models.token_texts == 0 and models.pairs == 0
    # An English question is reranked by the same models as before.
    english = await reranker.rerank(
        RerankInput("acme", "which river flows through warsaw", CANDIDATES, top_k=2)
    )
    assert not english.skipped and english.results[0].id == "gold"


async def test_only_the_stage_whose_model_does_not_read_the_question_is_skipped():
    models = Models()
    reranker = await make(models, pair_scripts=frozenset({"Latin"}))  # token model: any
    out = await reranker.rerank(RerankInput("acme", "华沙 river", CANDIDATES, top_k=2))
    assert out.stages_run == [LATE_INTERACTION]
    assert [(skip.stage, skip.cause) for skip in out.skipped] == [
        (CROSS_ENCODER, SkipCause.LANGUAGE)
    ]


async def test_an_english_question_over_chinese_candidates_is_not_scored_by_english_models():
    """An English model reads a Chinese passage as unknown tokens: it scores an English
    question against it no better than at random. A stage scores only what its model
    reads, the query and every candidate it would score; cross-lingual candidates keep
    the order a multilingual retrieval gave them."""
    models = Models()
    reranker = await make(
        models, token_scripts=frozenset({"Latin"}), pair_scripts=frozenset({"Latin"})
    )
    chinese = [
        Candidate("far", "华沙是波兰的首都。", 0.9),
        Candidate("gold", "维斯瓦河流经华沙。", 0.5),
    ]
    out = await reranker.rerank(RerankInput("acme", "which river flows through warsaw", chinese))
    assert [r.id for r in out.results] == ["far", "gold"]
    assert [skip.stage for skip in out.skipped] == [LATE_INTERACTION, CROSS_ENCODER]
    assert all("every candidate" in skip.reason for skip in out.skipped)
    assert models.token_texts == 0 and models.pairs == 0
