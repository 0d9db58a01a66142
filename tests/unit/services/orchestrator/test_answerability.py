"""The answerability gate's signals and decision (pure functions)."""

from __future__ import annotations

import pytest

from ragline_services.orchestrator import answerability
from ragline_services.orchestrator import evidence as ev

WARSAW = ev.Passage("w", "Warsaw", "The Vistula River divides Warsaw. Warsaw has many parks.")
SKY = ev.Passage("s", "Sky", "Sky UK launched Sky Q in 2016.")
MINILM = "minilm-l6"


def test_key_terms_are_names_and_numbers_after_the_first_word():
    assert answerability.key_terms("Who won the 2030 FIFA World Cup?") == [
        "2030",
        "fifa",
        "world",
        "cup",
    ]
    assert answerability.key_terms("Which river flows through Warsaw?") == ["warsaw"]
    assert answerability.key_terms("What is a river?") == []


def test_signals_read_coverage_and_key_terms_from_the_candidates():
    found = answerability.signals("Which river flows through Warsaw?", [SKY, WARSAW], [0.7, 0.2])
    assert found.similarity == 0.7
    assert found.key_terms == 1.0 and found.key_count == 1
    # river and Warsaw are in one passage, "flows" in none (and weighs most: it is rarest)
    assert 0.3 < found.coverage < 0.5
    assert answerability.signals("Which river divides Warsaw?", [SKY, WARSAW], [0.7]).coverage == 1
    missing = answerability.signals("Who won the 2030 FIFA World Cup?", [SKY, WARSAW], [0.2])
    assert missing.key_terms == 0.0 and missing.coverage < 0.2


def test_the_gate_abstains_below_its_threshold_and_says_why():
    relevant = answerability.Signals(0.75, coverage=0.9, key_terms=1.0, key_count=1, gate=MINILM)
    unrelated = answerability.Signals(0.3, coverage=0.1, key_terms=0.0, key_count=2, gate=MINILM)
    assert relevant.probability > 0.9 > 0.05 > unrelated.probability
    answerability.gate(relevant, 0.35)
    answerability.gate(unrelated, 0.0)  # 0: the gate is off
    with pytest.raises(answerability.NotAnswerable) as raised:
        answerability.gate(unrelated, 0.35)
    assert raised.value.reason == "no_relevant_evidence"
    assert raised.value.signals is unrelated
    assert "nothing was generated" in raised.value.detail


def test_without_embeddings_the_gate_reads_words_alone():
    covered = answerability.signals("Which river divides Warsaw?", [SKY, WARSAW], None)
    assert covered.similarity is None and covered.probability > 0.5
    missing = answerability.signals("Who won the 2030 FIFA World Cup?", [SKY, WARSAW], None)
    assert missing.probability < 0.25
    with pytest.raises(answerability.NotAnswerable) as raised:
        answerability.gate(missing, 0.25)
    assert "no sentence could be embedded" in raised.value.detail


def test_each_embedding_model_is_judged_by_the_fit_made_for_its_cosines():
    assert answerability.family_of("minilm-l6-int8-sq@9f2c") == "minilm-l6"
    assert answerability.family_of("minilm-l6-fp32@77aa") == "minilm-l6"
    assert answerability.family_of("me5-small-int8@01bc") == "me5-small"
    assert answerability.family_of("me5-small-q4") == "me5-small"
    assert answerability.family_of("bge-m3@0000") == answerability.LEXICAL_GATE
    question, passages = "Which river flows through Warsaw?", [SKY, WARSAW]
    minilm = answerability.signals(question, passages, [0.6], "minilm-l6-int8-sq@9f2c")
    me5 = answerability.signals(question, passages, [0.6], "me5-small-int8@01bc")
    assert (minilm.gate, me5.gate) == ("minilm-l6", "me5-small")
    # 0.6 is a close match for MiniLM and an unrelated pair for multilingual-e5, whose
    # cosines sit in ~0.7-0.95
    assert minilm.probability > 0.5 > me5.probability


def test_an_embedding_model_without_a_fit_leaves_the_gate_to_words():
    unknown = answerability.signals(
        "Who won the 2030 FIFA World Cup?", [SKY, WARSAW], [0.99], "x@1"
    )
    assert unknown.gate == answerability.LEXICAL_GATE and unknown.similarity == 0.99
    words_alone = answerability.signals("Who won the 2030 FIFA World Cup?", [SKY, WARSAW], None)
    assert unknown.probability == words_alone.probability < 0.25
    with pytest.raises(answerability.NotAnswerable) as raised:
        answerability.gate(unknown, 0.25)
    assert "no gate is fitted to the embedding model" in raised.value.detail


def test_a_chinese_pair_is_read_on_the_scale_the_fit_was_made_on():
    """multilingual-e5 scores a Chinese question and a Chinese sentence ~0.07 higher than
    an English pair of the same kind, and its fit was made on English: without the offset
    a Chinese question about an unrelated passage reads as a close match."""
    river = ev.Passage("r", "长江", "长江全长约6300公里。")
    offset = answerability.FITTED["me5-small"].chinese_offset
    assert offset < 0
    me5 = "me5-small-int8@01bc"
    chinese = answerability.signals("长江有多长？", [river], [0.86], me5, ["长江全长约6300公里。"])
    assert chinese.similarity == pytest.approx(0.86 + offset)
    # a Chinese question against an English sentence, an English question, another model:
    # read as they are
    english_sentence = answerability.signals("长江有多长？", [river], [0.86], me5, ["It is long."])
    assert english_sentence.similarity == pytest.approx(0.86)
    assert answerability.signals("How long?", [river], [0.86], me5, ["长江"]).similarity == 0.86
    minilm = answerability.signals("长江有多长？", [river], [0.86], "minilm-l6-x@1", ["长江"])
    assert minilm.similarity == 0.86
    # the best sentence after the offset is the one read
    both = answerability.signals("长江有多长？", [river], [0.86, 0.83], me5, ["长江", "It is."])
    assert both.similarity == pytest.approx(0.83)


YANGTZE = ev.Passage("y", "长江", "长江是中国第一长河，全长约6300公里，最终在上海注入东海。")
PANDA = ev.Passage("p", "大熊猫", "大熊猫是中国特有的熊科动物，主要以竹子为食。")
RHINE = ev.Passage("e", "Rhine", "The Rhine flows from the Alps into the North Sea.")


def test_a_question_in_the_other_language_is_covered_through_the_lexicon():
    """An English question over a Chinese passage shares no word with it; the lexicon's
    translations (whole glosses only) count as the words themselves."""
    across = answerability.signals("Into which sea does the Yangtze River flow?", [YANGTZE], None)
    assert across.coverage > 0.6 and across.key_terms == 1.0  # "flow" is not 注入
    # and the reverse: a Chinese question over an English passage
    reverse = answerability.signals("莱茵河流入哪个海？", [RHINE], None)
    assert reverse.coverage > 0.5
    # it tells the passage that answers from the one that does not
    other = answerability.signals("Into which sea does the Yangtze River flow?", [PANDA], None)
    assert other.coverage < 0.1 and other.key_terms == 0.0
    assert across.probability > 0.5 > other.probability


def test_without_the_lexicon_only_shared_spellings_cover(monkeypatch):
    monkeypatch.setattr(answerability, "the_lexicon", lambda: None)
    across = answerability.signals("Into which sea does the Yangtze River flow?", [YANGTZE], None)
    assert across.coverage == 0.0 and across.key_terms == 0.0
    # English over English is what it was
    assert answerability.signals("Which river divides Warsaw?", [SKY, WARSAW], None).coverage == 1


def test_a_question_whose_closest_sentence_is_in_the_other_language_is_judged_by_words():
    """me5-small scores a question and the sentence in the other language that answers it
    about as high as an unrelated pair: the fitted cosine scale does not apply, the words
    (through the lexicon) decide."""
    me5 = "me5-small-int8@01bc"
    question = "Into which sea does the Yangtze River flow?"
    sentence = "长江是中国第一长河，全长约6300公里，最终在上海注入东海。"
    across = answerability.signals(question, [YANGTZE], [0.80], me5, [sentence])
    assert across.gate == answerability.CROSS_LINGUAL_GATE
    assert across.probability == pytest.approx(
        answerability.LEXICAL.probability((across.coverage, across.key_terms))
    )
    assert across.probability > 0.25  # the fitted scale would read 0.80 as unrelated
    fitted = answerability.FITTED["me5-small"].probability(
        (0.80, across.coverage, across.key_terms)
    )
    assert fitted < 0.25
    # another passage's sentence in the other language: refused, and the refusal says why
    other = answerability.signals(question, [PANDA], [0.80], me5, ["大熊猫主要以竹子为食。"])
    with pytest.raises(answerability.NotAnswerable) as raised:
        answerability.gate(other, 0.25)
    assert "in another language than the question" in raised.value.detail
    # the closest sentence in the question's language, but the passage holding most of
    # its words in the other: judged by words (an English river passage must not decide a
    # question the Chinese one answers)
    mixed = answerability.signals(
        question, [YANGTZE, RHINE], [0.80, 0.83], me5, [sentence, "The Rhine flows."]
    )
    assert mixed.gate == answerability.CROSS_LINGUAL_GATE and mixed.probability > 0.25
    # both in the question's language: the fitted gate, as before
    rhine = answerability.signals(
        "Into which sea does the Rhine flow?",
        [YANGTZE, RHINE],
        [0.80, 0.83],
        me5,
        [sentence, "The Rhine flows."],
    )
    assert rhine.gate == "me5-small"


def test_a_sentence_is_in_the_language_most_of_it_is_written_in():
    """An English sentence that names something in characters is English to the gate; a
    Chinese sentence with English terms is Chinese."""
    me5 = "me5-small-int8@01bc"
    kublai = ev.Passage("k", "Yuan", "Kublai Khan (忽必烈) founded the Yuan dynasty in 1271.")
    named = answerability.signals(
        "Who founded the Yuan dynasty?", [kublai], [0.9], me5, [kublai.text]
    )
    assert named.gate == "me5-small"
    kv = "高频 query 的 KV Cache 存放在 Redis 中。"
    mixed = answerability.signals(
        "Where is the KV cache stored?", [ev.Passage("c", "KV", kv)], [0.8], me5, [kv]
    )
    assert mixed.gate == answerability.CROSS_LINGUAL_GATE


def test_chinese_names_of_two_characters_or_more_are_key_terms():
    assert answerability.key_terms("莱茵河流入哪个海？") == ["莱茵", "茵河"]
    # 中 is a name in the lexicon (China) and also "in": one character is not a key
    assert answerability.key_terms("京剧中俗称“花脸”的是哪个行当？") == ["京剧"]
