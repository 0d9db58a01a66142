"""The Chinese-English lexicon: CC-CEDICT's lines read, glosses kept only where they
translate, both directions in the checks' own terms, and the derived form cached."""

from __future__ import annotations

from ragline import lexicon

LINES = [
    "# CC-CEDICT",
    "長江 长江 [Chang2 Jiang1] /Yangtze River, or Chang Jiang/",
    "東海 东海 [Dong1 Hai3] /East China Sea/East Sea (Korean name for Sea of Japan)/",
    "河 河 [he2] /river/CL:條|条[tiao2],道[dao4]/",
    "長 长 [chang2] /length/long/forever/always/constantly/",
    "紅茶 红茶 [hong2 cha2] /black tea/CL:杯[bei1],壺|壶[hu2]/",
    "重建 重建 [chong2 jian4] /to rebuild; to reestablish/reconstruction/",
    "茶 茶 [cha2] /tea/tea plant/",
    "乾 干 [gan1] /variant of 干[gan1]/surname Gan/dry/",
    "3C 3C [san1 C] /abbr. for computers, communications, and consumer electronics/",
    "蟲草 虫草 [chong2 cao3] /cordyceps, a kind of fungus that grows in the larvae of moths",
]


def small() -> lexicon.Lexicon:
    return lexicon.Lexicon(*lexicon.derive(lexicon.parse(LINES)))


def test_lines_are_read_as_entries_and_broken_lines_skipped():
    entries = lexicon.parse(LINES)
    assert [e.simplified for e in entries][:3] == ["长江", "东海", "河"]
    assert entries[0].traditional == "長江"
    assert entries[0].glosses == ("Yangtze River, or Chang Jiang",)
    assert "虫草" not in {e.simplified for e in entries}  # no closing slash


def test_only_glosses_that_translate_are_kept():
    words = small()
    assert frozenset({"yangtze", "river"}) in words.english("长江")
    assert frozenset({"chang", "jiang"}) in words.english("长江")  # "or Chang Jiang"
    assert words.english("長江") == words.english("长江")  # traditional too
    # classifiers, cross-references and surnames are not translations
    assert words.english("干") == [frozenset({"dry"})]
    assert words.english("河") == [frozenset({"river"})]
    assert words.english("重建") == [
        frozenset({"rebuild"}),
        frozenset({"reestablish"}),
        frozenset({"reconstruction"}),
    ]
    assert words.english("3C") == []  # not Chinese characters
    assert words.english("没有") == []


def test_an_english_word_is_translated_only_where_its_whole_gloss_is_in_context():
    words = small()
    question = {"sea", "yangtze", "river", "flow"}
    assert words.chinese("yangtze", question) == {"长江", "長江"}
    assert "长江" in words.chinese("river", question)
    assert "河" in words.chinese("river", question)
    # "river" without "yangtze" beside it is any river, not the Yangtze
    assert words.chinese("river", {"river", "long"}) == {"河"}
    # "tea" is 茶; 红茶 needs "black" beside it
    assert words.chinese("tea", {"tea"}) == {"茶"}
    assert words.chinese("tea", {"black", "tea"}) == {"茶", "红茶", "紅茶"}
    assert words.chinese("sea", {"sea"}) == set()  # every gloss of 东海 has more words


def test_the_derived_form_is_cached_and_read_back(tmp_path, monkeypatch):
    dictionary = "\n".join(LINES).encode()
    monkeypatch.setattr(lexicon, "_dictionary_bytes", lambda: dictionary)
    first = lexicon.load(tmp_path)
    written = list((tmp_path / "lexicon").iterdir())
    assert [p.name for p in written] == [lexicon.derived_name(dictionary)]
    # read back, not derived again
    monkeypatch.setattr(lexicon, "derive", lambda entries: ({"假": "fake"}, {"fake": "假"}, ""))
    again = lexicon.load(tmp_path)
    assert again.english("长江") == first.english("长江")
    # another dictionary is another file
    assert lexicon.derived_name(dictionary + b"\n") != written[0].name


def test_an_unreadable_cache_file_is_derived_again(tmp_path, monkeypatch):
    dictionary = "\n".join(LINES).encode()
    monkeypatch.setattr(lexicon, "_dictionary_bytes", lambda: dictionary)
    path = tmp_path / "lexicon" / lexicon.derived_name(dictionary)
    path.parent.mkdir()
    path.write_bytes(b"\x00broken")
    assert lexicon.load(tmp_path).english("河") == [frozenset({"river"})]


def test_without_the_package_there_is_no_lexicon(tmp_path, monkeypatch):
    monkeypatch.setattr(lexicon, "_dictionary_bytes", lambda: None)
    assert lexicon.load(tmp_path) is None


def test_the_packaged_dictionary_is_read():
    words = lexicon.shared()
    assert words is not None and len(words) > 100_000
    assert frozenset({"yangtze", "river"}) in words.english("长江")
