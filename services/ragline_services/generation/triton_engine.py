"""Generation on Triton: a TensorRT-LLM ensemble streamed over KServe v2 `ModelStreamInfer`.

Speaks the TensorRT-LLM ensemble tensors of `ENSEMBLE_INPUTS` -> `text_output` (BYTES, the
UTF-8 bytes of each streamed step, decoded here incrementally: a step may end inside a
character). Token counts come from the repository's `preprocessing` model
(`REQUEST_INPUT_LEN`). The request asks Triton for an empty final response
(`triton_enable_empty_final_response`), so the end of every stream is explicit; cancelling
the gRPC stream cancels the request on the server. tritonclient's aio streaming API cannot
set that parameter, so requests are built from its generated protobuf stubs directly.
"""

from __future__ import annotations

import codecs
import struct
from collections.abc import AsyncGenerator

import grpc
import numpy as np

from ragline import control_tokens, deadlines
from ragline.clients import RECONNECT_OPTIONS, open_channel
from ragline.errors import InvalidArgument, Unavailable
from ragline.tls import TlsConfig
from ragline_services.generation.engine import StreamEvent

_CHATML_ROLES = ("system", "user", "assistant")

# What this adapter sends, by tensor name and KServe datatype: the contract every ensemble
# in deploy/triton/generation declares (tests/deploy checks that they agree).
ENSEMBLE_INPUTS = {
    "text_input": "BYTES",
    "max_tokens": "UINT32",
    "stream": "BOOL",
    "temperature": "FP32",
    "top_p": "FP32",
    "top_k": "UINT32",
}
ENSEMBLE_OUTPUT = "text_output"
PREPROCESSING_INPUTS = {"QUERY": "BYTES", "REQUEST_OUTPUT_LEN": "UINT32"}
PREPROCESSING_COUNT_OUTPUT = "REQUEST_INPUT_LEN"


def encode_bytes(items: list[bytes]) -> bytes:
    """Triton's BYTES tensor layout: each element prefixed with its little-endian length."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def decode_bytes(raw: bytes) -> list[bytes]:
    items, offset = [], 0
    while offset < len(raw):
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        items.append(raw[offset : offset + length])
        offset += length
    return items


def render_chatml(messages: list[dict[str, str]]) -> str:
    """ChatML, the template of the Qwen2.5 models this deployment serves."""
    parts = []
    for message in messages:
        if message["role"] not in _CHATML_ROLES:
            raise InvalidArgument("chat.messages.role", f"{message['role']!r} is not a chat role")
        # The whole prompt is tokenized at once (Triton's preprocessing model): a
        # content's control-token look-alikes are defused so they stay text.
        content = control_tokens.defuse(message["content"])
        parts.append(f"<|im_start|>{message['role']}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class TritonGenerationEngine:
    """A TensorRT-LLM ensemble on Triton behind the GenerationEngine interface."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        preprocessing_model: str = "preprocessing",
        context_window: int = 4096,
        timeout_s: float = 600.0,
        tls: TlsConfig | None = None,
    ) -> None:
        """`tls`: reach Triton under TLS with these credentials."""
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self._pb = service_pb2
        self._channel = open_channel(url, tls or TlsConfig(mode="off"), RECONNECT_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self.url = url
        self.model = model
        self.preprocessing_model = preprocessing_model
        self.context_window = context_window
        self._timeout_s = timeout_s

    async def start(self) -> None:
        for model in (self.model, self.preprocessing_model):
            try:
                ready = await self._stub.ModelReady(
                    self._pb.ModelReadyRequest(name=model), timeout=10
                )
            except grpc.aio.AioRpcError as error:
                raise Unavailable(f"Triton at {self.url} unreachable: {error.details()}") from error
            if not ready.ready:
                raise Unavailable(f"Triton at {self.url} has no ready model {model!r}")

    async def close(self) -> None:
        await self._channel.close()

    @staticmethod
    def _tensor(request, contract: dict[str, str], name: str, raw: bytes) -> None:
        request.inputs.add(name=name, datatype=contract[name], shape=[1, 1])
        request.raw_input_contents.append(raw)

    async def render_chat(self, messages: list[dict[str, str]]) -> str:
        return render_chatml(messages)

    async def count_tokens(self, text: str) -> int:
        request = self._pb.ModelInferRequest(model_name=self.preprocessing_model)
        self._tensor(request, PREPROCESSING_INPUTS, "QUERY", encode_bytes([text.encode()]))
        self._tensor(
            request, PREPROCESSING_INPUTS, "REQUEST_OUTPUT_LEN", np.array([1], "<u4").tobytes()
        )
        request.outputs.add(name=PREPROCESSING_COUNT_OUTPUT)
        try:
            reply = await self._stub.ModelInfer(
                request, timeout=deadlines.outbound_timeout("Triton", stage_budget_s=30.0)
            )
        except grpc.aio.AioRpcError as error:
            raise Unavailable(f"Triton preprocessing failed: {error.details()}") from error
        return int(np.frombuffer(reply.raw_output_contents[0], dtype=np.int32)[0])

    async def erase_slot(self, slot: int) -> None:
        """Nothing to erase: Triton keeps no per-slot cache that this service addresses."""

    async def stream(
        self,
        prompt: str,
        *,
        slot: int,
        max_tokens: int,
        sampling: dict,
        prompt_ids: list[int] | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        request = self._pb.ModelInferRequest(model_name=self.model, id=f"slot-{slot}")
        values = {
            "text_input": encode_bytes([prompt.encode()]),
            "max_tokens": np.array([max_tokens], "<u4").tobytes(),
            "stream": np.array([True], np.bool_).tobytes(),
            "temperature": np.array([sampling.get("temperature", 0.0)], "<f4").tobytes(),
            "top_p": np.array([sampling.get("top_p", 1.0)], "<f4").tobytes(),
            "top_k": np.array([sampling.get("top_k", 0) or 1], "<u4").tobytes(),
        }
        for name, raw in values.items():
            self._tensor(request, ENSEMBLE_INPUTS, name, raw)
        request.outputs.add(name=ENSEMBLE_OUTPUT)
        request.parameters["triton_enable_empty_final_response"].bool_param = True

        async def requests():
            yield request

        call = self._stub.ModelStreamInfer(
            requests(),
            timeout=deadlines.outbound_timeout("Triton", stage_budget_s=self._timeout_s),
        )
        pieces: list[str] = []
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            async for response in call:
                if response.error_message:
                    raise Unavailable(f"Triton generation failed: {response.error_message}")
                infer = response.infer_response
                for output, raw in zip(infer.outputs, infer.raw_output_contents, strict=False):
                    if output.name == ENSEMBLE_OUTPUT:
                        text = utf8.decode(b"".join(decode_bytes(raw)))
                        if text:
                            pieces.append(text)
                            yield StreamEvent(text=text)
                if infer.parameters["triton_final_response"].bool_param:
                    break
        except grpc.aio.AioRpcError as error:
            raise Unavailable(f"Triton stream failed: {error.details()}") from error
        finally:
            call.cancel()  # a no-op after the final response; stops generation otherwise
        tail = utf8.decode(b"", final=True)  # a character the stream ended inside
        if tail:
            pieces.append(tail)
            yield StreamEvent(text=tail)
        completion = await self.count_tokens("".join(pieces)) if pieces else 0
        yield StreamEvent(
            final=True,
            stop_type="limit" if completion >= max_tokens else "eos",
            completion_tokens=completion,
        )
