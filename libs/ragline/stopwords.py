"""English stop words dropped from BM25 queries (never from documents), and from the query
tokens that rerank's late interaction averages over.

Lucene's default English set plus question words, pronouns and auxiliaries: questions are
full of them ("what", "which", "the", "of"), they match nearly every document (so block
pruning cannot skip anything), and inside short title fields BM25 weighs them high.
Measured by tools/eval_bm25_stopwords.py (a third of the questions): SQuAD dev nDCG@10
0.860 -> 0.869, new_wiki 0.875 -> 0.878, BM25 search p50 about 20 % faster at 2k passages
(Lucene's 33 words alone: 0.859 / 0.874). A query of stop words only is searched as it is.
In MaxSim (a stop word's best match says little about a passage): hybrid + stage 1 on SQuAD
dev 0.924 -> 0.927 nDCG@10 (tools/eval_retrieval.py, 1,000 questions).
"""

from __future__ import annotations

STOP_WORDS = frozenset(
    """a an and are as at be but by for if in into is it no not of on or such that the their
    then there these they this to was will with what which who whom whose when where why how
    do does did were been being have has had having i me my we our you your he him his she
    her its them about above after again against all am any because before below between
    both can could down during each few from further here more most other out over own same
    should so some than too under until up very would s t just don now only off once through
    while""".split()
)


def without_stop_words(words: list[str], stop_words: frozenset[str] = STOP_WORDS) -> list[str]:
    kept = [w for w in words if w not in stop_words]
    return kept or words


# Chinese function words and question words, as jieba segments them: dropped from BM25
# queries for the same reasons (questions are full of 什么 / 哪 / 多少 / 是 / 的, which
# match nearly every passage). Documents keep them.
CHINESE_STOP_WORDS = frozenset(
    """的 地 得 了 着 过 是 在 和 与 及 或 也 都 就 而 把 被 让 给 对 从 向 于 以 为 之 其 这 那
    这个 那个 这些 那些 这种 那种 一个 一种 有 没有 个 吗 呢 吧 啊 呀 么 什么 啥 哪 哪里 哪儿
    哪个 哪些 哪种 哪一 多少 几 几个 怎么 怎样 怎么样 如何 为什么 为何 谁 是否 是不是 请问 请
    可以 能 能否 会 要 需要 我 你 您 他 她 它 我们 你们 他们 其中 所 等 里 又 还 即 则 但 但是
    因为 所以 如果 并 并且 呢 吗 么""".split()
)
