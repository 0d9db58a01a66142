"""TensorRT-LLM ensemble `postprocessing`: one streamed step's token ids -> their bytes.

Byte-level BPE (Qwen2.5, GPT-2 family) can split one character over two tokens, so a step
is returned as the raw UTF-8 bytes of its tokens, never as decoded text: the caller decodes
the stream incrementally. Other tokenizers (WordPiece, SentencePiece) decode per step.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character table (GPT-2's
    bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to U+0100...)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


class TokenBytes:
    """Token ids -> bytes, for the tokenizer of one tokenizer.json."""

    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        self.byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self._bytes_of = _byte_decoder()
        self._special = {
            entry["id"] for entry in spec.get("added_tokens", ()) if entry.get("special")
        }

    def __call__(self, ids) -> bytes:
        ids = [int(i) for i in ids if int(i) not in self._special]
        if not self.byte_level:
            return self.tokenizer.decode(ids).encode("utf-8")
        out = bytearray()
        for token_id in ids:
            token = self.tokenizer.id_to_token(token_id) or ""
            out += bytes(self._bytes_of[c] for c in token if c in self._bytes_of)
        return bytes(out)


def step_bytes(token_bytes: TokenBytes, tokens_batch, sequence_length) -> np.ndarray:
    """[batch, beams, tokens] ids with [batch, beams] lengths -> [batch, beams] bytes."""
    tokens = np.asarray(tokens_batch)
    lengths = np.asarray(sequence_length).reshape(tokens.shape[0], -1)
    out = np.empty(lengths.shape, dtype=np.object_)
    for row in range(tokens.shape[0]):
        for beam in range(lengths.shape[1]):
            out[row, beam] = token_bytes(tokens[row, beam, : lengths[row, beam]])
    return out


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        directory = Path(parameters["tokenizer_dir"]["string_value"])
        self.token_bytes = TokenBytes(directory / "tokenizer.json")

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            output = step_bytes(self.token_bytes, tokens, lengths)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)])
            )
        return responses
