"""The GPU ensemble's own python models (deploy/triton/generation/gpu preprocessing and
postprocessing), run as functions on real tokenizers: a byte-level BPE trained here (the
Qwen2.5 / GPT-2 kind, which splits characters over tokens) and the MiniLM WordPiece one.
The same models on the real tritonserver: tests/deploy/test_triton_text_models_served.py."""

from __future__ import annotations

import codecs
import importlib.util
import re

import numpy as np
import pytest

from support import REPO_ROOT
from support.tokenizers import byte_level_tokenizer

GPU = REPO_ROOT / "deploy" / "triton" / "generation" / "gpu"
# 😀 and ß are not in the tokenizer's training text: they stay split into single bytes.
TEXT = "Zürich liegt am Zürichsee; 東京 is Tokyo, naïve café 😀 an der Straße."


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / name / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocessing = _load("preprocessing")
postprocessing = _load("postprocessing")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return byte_level_tokenizer(tmp_path_factory.mktemp("bpe"))


def test_prompts_are_tokenized_padded_and_counted(bpe_dir):
    tokenizer = preprocessing.load_tokenizer(str(bpe_dir))
    pad = preprocessing.special_id(tokenizer, "<|endoftext|>")
    out = preprocessing.tokenize_batch(tokenizer, [TEXT.encode(), b"Tokyo"], [16, 4], pad)
    lengths = out["REQUEST_INPUT_LEN"].reshape(-1)
    assert lengths[0] == len(tokenizer.encode(TEXT, add_special_tokens=False).ids)
    assert lengths[1] < lengths[0]
    assert out["INPUT_ID"].shape == (2, lengths[0]) and out["INPUT_ID"].dtype == np.int32
    assert (out["INPUT_ID"][1, lengths[1] :] == pad).all()
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[16], [4]]


def test_a_missing_end_token_is_named(bpe_dir):
    tokenizer = preprocessing.load_tokenizer(str(bpe_dir))
    with pytest.raises(ValueError, match=re.escape("no token '<|eot_id|>'")):
        preprocessing.special_id(tokenizer, "<|eot_id|>")
    assert preprocessing.special_id(tokenizer, "<|eot_id|>", "<|im_end|>") == (
        tokenizer.token_to_id("<|im_end|>")
    )


def test_streamed_steps_of_one_token_decode_to_the_exact_text(bpe_dir):
    """One token per step, as the engine streams: some steps end inside a character, yet
    the stream decoded incrementally (what the service does) is the text, byte for byte."""
    tokenizer = preprocessing.load_tokenizer(str(bpe_dir))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    token_bytes = postprocessing.TokenBytes(bpe_dir / "tokenizer.json")
    assert token_bytes.byte_level
    steps = [
        postprocessing.step_bytes(token_bytes, np.array([[[i]]]), np.array([[1]]))[0, 0]
        for i in ids
    ]
    broken = [s for s in steps if _is_partial(s)]
    assert broken, "the text should make some token end inside a character"
    utf8 = codecs.getincrementaldecoder("utf-8")()
    assert "".join(utf8.decode(s) for s in steps) + utf8.decode(b"", final=True) == TEXT


def test_special_tokens_and_padding_past_the_length_are_not_output(bpe_dir):
    tokenizer = preprocessing.load_tokenizer(str(bpe_dir))
    ids = tokenizer.encode("Tokyo", add_special_tokens=False).ids
    end = tokenizer.token_to_id("<|endoftext|>")
    batch = np.array([[[*ids, end, end, end]]], dtype=np.int32)
    token_bytes = postprocessing.TokenBytes(bpe_dir / "tokenizer.json")
    assert postprocessing.step_bytes(token_bytes, batch, np.array([[len(ids) + 1]]))[0, 0] == (
        b"Tokyo"
    )


def test_wordpiece_tokenizers_decode_per_step():
    from ragline.models import ModelStore

    store = ModelStore()
    store.prepare("all-minilm-l6-v2")
    token_bytes = postprocessing.TokenBytes(store.file("all-minilm-l6-v2", "tokenizer.json"))
    assert not token_bytes.byte_level
    ids = token_bytes.tokenizer.encode("the river flows", add_special_tokens=False).ids
    assert token_bytes(ids) == b"the river flows"


def _is_partial(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
