"""TensorRT-LLM ensemble `preprocessing`: prompt text -> token ids for the engine.

Also the service's token counter: it calls this model alone with QUERY and reads
REQUEST_INPUT_LEN. Inputs come as [batch, 1]; every output is [batch, ...] int32, ids
right-padded with the pad id.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load_tokenizer(directory: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))


def special_id(tokenizer, token: str, fallback: str = "") -> int:
    for name in (token, fallback):
        if name and tokenizer.token_to_id(name) is not None:
            return int(tokenizer.token_to_id(name))
    also = f" or {fallback!r}" if fallback else ""
    raise ValueError(f"the tokenizer has no token {token!r}{also}")


def as_text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def tokenize_batch(tokenizer, queries, output_lens, pad_id: int) -> dict[str, np.ndarray]:
    """The engine's inputs for a batch of prompts (special tokens are the prompt's own:
    the service renders the chat template, nothing is added here)."""
    encodings = [tokenizer.encode(as_text(q), add_special_tokens=False).ids for q in queries]
    width = max((len(ids) for ids in encodings), default=0) or 1
    input_ids = np.full((len(encodings), width), pad_id, dtype=np.int32)
    for row, ids in enumerate(encodings):
        input_ids[row, : len(ids)] = ids
    lengths = np.array([[len(ids)] for ids in encodings], dtype=np.int32)
    return {
        "INPUT_ID": input_ids,
        "REQUEST_INPUT_LEN": lengths,
        "REQUEST_OUTPUT_LEN": np.asarray(output_lens, dtype=np.int32).reshape(-1, 1),
    }


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        self.tokenizer = load_tokenizer(parameters["tokenizer_dir"]["string_value"])
        end_token = parameters["end_token"]["string_value"]
        self.end_id = special_id(self.tokenizer, end_token)
        self.pad_id = special_id(self.tokenizer, parameters["pad_token"]["string_value"], end_token)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            queries = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)
            lens = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy()
            outputs = tokenize_batch(self.tokenizer, queries, lens.reshape(-1), self.pad_id)
            rows = len(queries)
            outputs["END_ID"] = np.full((rows, 1), self.end_id, dtype=np.int32)
            outputs["PAD_ID"] = np.full((rows, 1), self.pad_id, dtype=np.int32)
            tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
