"""The rerank settings reach the models they name (in process, the real models)."""

from __future__ import annotations

import pytest

from ragline.models import ModelStore
from ragline_services.rerank.service import RerankConfig, build_reranker

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("asked", "kept"), [(64, 64), (96, 96), (0, 128), (512, 128)])
async def test_cross_encoder_pairs_are_cut_to_the_setting_never_past_the_model(asked, kept):
    store = ModelStore()
    built = await build_reranker(
        RerankConfig(cross_encoder_max_tokens=asked, prepare_models=False), store
    )
    try:
        tokenizer = built.reranker.pair_tokenizer
        assert store.spec("minilm-ce-l3-int8").max_tokens == 128
        assert tokenizer.max_tokens == kept
        (pair,) = tokenizer.encode_pairs([("which river?", "the Vistula flows north " * 80)])
        assert pair.length == kept
    finally:
        await built.close()


@pytest.mark.parametrize(("setting", "threads"), [(0, 1), (2, 2)])
async def test_the_cross_encoder_runs_on_its_own_thread_count(setting, threads):
    built = await build_reranker(
        RerankConfig(cross_encoder_threads=setting, prepare_models=False), ModelStore()
    )
    try:
        cross = next(m for m in built.models if type(m).__name__ == "CrossEncoder")
        options = cross._session.get_session_options()
        assert options.intra_op_num_threads == threads
    finally:
        await built.close()
