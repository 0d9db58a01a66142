"""The GPU ensemble's preprocessing and postprocessing models loaded by the real
tritonserver 2.51 (python backend, CPU; the engine between them needs a GPU): a prompt is
tokenized and counted the way the service's adapter asks, and a step's tokens come back
as the bytes the adapter decodes."""

from __future__ import annotations

import codecs

import numpy as np
import pytest

pytestmark = pytest.mark.deploy

TEXT = "Zürich liegt am Zürichsee; 東京 is Tokyo 😀."


def _infer(url: str, model: str, inputs: dict[str, np.ndarray], outputs: list[str]):
    from tritonclient import grpc as triton
    from tritonclient.utils import np_to_triton_dtype

    client = triton.InferenceServerClient(url)
    tensors = []
    for name, array in inputs.items():
        tensor = triton.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer(model, tensors, outputs=[triton.InferRequestedOutput(o) for o in outputs])
    return {name: result.as_numpy(name) for name in outputs}


def test_preprocessing_counts_and_tokenizes_on_the_real_server(triton_text_models):
    from tokenizers import Tokenizer

    server, tokenizer_dir = triton_text_models
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    expected = tokenizer.encode(TEXT, add_special_tokens=False).ids
    out = _infer(
        server.grpc_url,
        "preprocessing",
        {
            "QUERY": np.array([[TEXT.encode()]], dtype=np.object_),
            "REQUEST_OUTPUT_LEN": np.array([[32]], dtype=np.uint32),
        },
        ["INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "END_ID", "PAD_ID"],
    )
    assert out["INPUT_ID"].tolist() == [expected]
    assert out["REQUEST_INPUT_LEN"].tolist() == [[len(expected)]]
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[32]]
    assert out["END_ID"].tolist() == [[tokenizer.token_to_id("<|im_end|>")]]
    assert out["PAD_ID"].tolist() == [[tokenizer.token_to_id("<|endoftext|>")]]


def test_postprocessing_returns_bytes_that_decode_to_the_text(triton_text_models):
    from tokenizers import Tokenizer

    server, tokenizer_dir = triton_text_models
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    utf8 = codecs.getincrementaldecoder("utf-8")()
    text = ""
    for token in ids:  # one step per token, as the engine streams
        out = _infer(
            server.grpc_url,
            "postprocessing",
            {
                "TOKENS_BATCH": np.array([[[token]]], dtype=np.int32),
                "SEQUENCE_LENGTH": np.array([[1]], dtype=np.int32),
            },
            ["OUTPUT"],
        )
        text += utf8.decode(out["OUTPUT"].reshape(-1)[0])
    assert text + utf8.decode(b"", final=True) == TEXT
