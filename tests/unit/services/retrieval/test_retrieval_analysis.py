"""BM25's lexical analysis of Chinese, English and mixed text (analysis.py)."""

from __future__ import annotations

import pytest

from ragline_services.retrieval.analysis import Analyzer


@pytest.fixture(scope="module")
def analyzer() -> Analyzer:
    return Analyzer()


def words(analyzer: Analyzer, text: str) -> list[str]:
    return [token for token, _, _ in analyzer.document_tokens(text)]


def test_han_runs_are_segmented_and_latin_runs_analysed_as_before(analyzer):
    assert words(analyzer, "用双缓冲索引解决HNSW重建阻塞查询") == [
        "用",
        "双",
        "缓冲",
        "索引",
        "解决",
        "hnsw",
        "重建",
        "阻塞",
        "查询",
    ]
    # English exactly as tantivy's en_stem: lower-cased, stemmed, punctuation out.
    assert words(analyzer, "Rebuilding indexes, quickly!") == ["rebuild", "index", "quick"]


def test_offsets_point_at_each_han_word(analyzer):
    text = "长江注入东海"
    for token, start, end in analyzer.document_tokens(text):
        assert text[start:end] == token


def test_full_width_forms_match_their_ascii_ones(analyzer):
    assert words(analyzer, "\uff28\uff2e\uff33\uff37 \uff11\uff10ms") == ["hnsw", "10ms"]
    assert analyzer.query_words("\uff28\uff2e\uff33\uff37") == ["hnsw"]


def test_queries_lose_chinese_and_english_stop_words(analyzer):
    assert analyzer.query_words("高频 query 的 KV Cache 缓存在哪里，TTL 是多少？") == [
        "高频",
        "query",
        "kv",
        "cache",
        "缓存",
        "ttl",
    ]
    assert analyzer.query_words("What is the capital of France?") == ["capital", "france"]
    assert analyzer.query_words("是什么") == ["是", "什么"]  # only stop words: kept


def test_a_long_word_also_yields_the_words_inside_it(analyzer):
    """Search mode: a question using a shorter word still meets the passage."""
    assert {"人民", "共和国"} <= set(words(analyzer, "中华人民共和国"))


def test_a_query_is_translated_into_the_other_language(analyzer):
    """The lexicon's words for what the query says, in the other language: the whole gloss
    must be in the query ("Yangtze River" -> 长江; "river" alone is not the Yangtze)."""
    english = analyzer.translations("Into which sea does the Yangtze River flow?")
    assert "长江" in english and len(english) <= 3 * 4  # the commonest three per word
    assert "长江" not in analyzer.translations("Which river flows through Warsaw?")
    chinese = analyzer.translations("莱茵河发源于哪里？")
    assert {"rhine", "river"} <= set(chinese)
    # nothing the query already says, no function words
    assert "rhine" not in analyzer.translations("莱茵河 Rhine")
    assert analyzer.translations("") == []
