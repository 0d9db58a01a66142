"""Embedding backend on a Triton Inference Server (KServe v2 ModelInfer over gRPC).

Production: a TensorRT engine on a GPU node (deploy/triton/embedding/gpu). The service
still tokenizes, batches and buckets by length; Triton runs the padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ragline import deadlines
from ragline.errors import Unavailable
from ragline.pooling import normalise
from ragline.tls import TlsConfig

# What this backend sends (name -> KServe datatype) and reads: the contract of every
# embedding repository in deploy/triton/embedding (tests/deploy checks that they agree).
MODEL_INPUTS = {"input_ids": "INT64", "attention_mask": "INT64"}
MODEL_OUTPUT = "sentence_embedding"


# Config parameters by which a Triton model says what its vectors are: the version they
# carry (caches and indexes key on it) and whether a text's vector is the same whatever
# shares its batch (then the service batches). tools/build_trt_engine.py writes them.
VERSION_PARAMETER = "ragline_model_version"
BATCH_INVARIANT_PARAMETER = "ragline_batch_invariant"


@dataclass(frozen=True)
class DeclaredModel:
    version: str
    batch_invariant: bool


class TritonBackend:
    name = "triton"
    # Triton schedules its own model instances: one batch at a time from here is enough.
    parallel_runs = 1

    def __init__(
        self,
        url: str,
        model: str,
        dim: int,
        *,
        timeout_s: float = 10.0,
        tls: TlsConfig | None = None,
    ) -> None:
        """`tls`: reach Triton under TLS with these credentials (its CA; this process's
        certificate under mtls)."""
        from tritonclient.grpc import aio as triton_grpc

        self._triton = triton_grpc
        credentials = tls.channel_credentials() if tls is not None and tls.on else None
        self._client = triton_grpc.InferenceServerClient(url, creds=credentials)
        self.url = url
        self.model = model
        self.dim = dim
        self._timeout_s = timeout_s

    async def check_ready(self) -> None:
        from tritonclient.utils import InferenceServerException

        try:
            ready = await self._client.is_model_ready(self.model)
        except InferenceServerException as error:
            raise Unavailable(f"Triton at {self.url} unreachable: {error}") from error
        if not ready:
            raise Unavailable(f"Triton at {self.url} has no ready model {self.model!r}")

    async def declared(self) -> DeclaredModel | None:
        """What the served model declares about its vectors (None: it declares nothing)."""
        from tritonclient.utils import InferenceServerException

        try:
            reply = await self._client.get_model_config(self.model, as_json=True)
        except InferenceServerException as error:
            raise Unavailable(
                f"Triton at {self.url}: no config of {self.model!r}: {error}"
            ) from error
        parameters = reply.get("config", {}).get("parameters", {})

        def text(name: str) -> str:
            return str(parameters.get(name, {}).get("string_value", "")).strip()

        if not text(VERSION_PARAMETER):
            return None
        return DeclaredModel(text(VERSION_PARAMETER), text(BATCH_INVARIANT_PARAMETER) == "true")

    async def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        from tritonclient.utils import InferenceServerException

        inputs = []
        for name, array in (("input_ids", input_ids), ("attention_mask", attention_mask)):
            tensor = self._triton.InferInput(name, list(array.shape), MODEL_INPUTS[name])
            tensor.set_data_from_numpy(np.ascontiguousarray(array, dtype=np.int64))
            inputs.append(tensor)
        try:
            result = await self._client.infer(
                self.model,
                inputs,
                outputs=[self._triton.InferRequestedOutput(MODEL_OUTPUT)],
                client_timeout=deadlines.outbound_timeout("Triton", stage_budget_s=self._timeout_s),
            )
        except InferenceServerException as error:
            raise Unavailable(
                f"Triton inference failed ({self.url}, {self.model}): {error}"
            ) from error
        vectors = result.as_numpy(MODEL_OUTPUT)
        if vectors is None or vectors.shape != (input_ids.shape[0], self.dim):
            raise Unavailable(
                f"Triton model {self.model} returned shape "
                f"{None if vectors is None else vectors.shape}, expected "
                f"({input_ids.shape[0]}, {self.dim})"
            )
        return normalise(vectors)

    async def close(self) -> None:
        await self._client.close()
