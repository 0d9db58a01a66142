"""Embedding backends behind one interface: token ids in, L2-normalised vectors out.

- OnnxRuntimeBackend: ONNX Runtime in process (the embedded CPU default, and in-process
  query encoders).
- Triton (the production GPU path) is a backend of the embedding service's own.
Both see the same padded batch: input_ids, attention_mask (and token_type_ids).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Protocol

import numpy as np

from ragline.pooling import mean_pool_normalise, normalise


class EmbeddingBackend(Protocol):
    name: str
    dim: int
    # Model runs it takes at once: the batcher keeps that many batches in flight.
    parallel_runs: int

    async def check_ready(self) -> None:
        """Raises Unavailable unless the backend can run the model now."""

    async def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """[batch, tokens] int64 -> [batch, dim] float32, each row L2-normalised."""

    async def close(self) -> None: ...


class OnnxRuntimeBackend:
    """ONNX Runtime on the CPU. Up to `parallel_runs` model runs at once, each on its own
    thread (the batcher feeds them whole batches; one session serves concurrent runs), so
    the event loop never blocks on inference."""

    name = "onnxruntime"

    def __init__(
        self, model_path: Path, *, intra_op_threads: int = 1, parallel_runs: int = 1
    ) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        # One thread per worker: on a small shared box threads fight (docs/tuning.md);
        # scale by parallel runs, batching and processes instead.
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(
            str(model_path), options, providers=["CPUExecutionProvider"]
        )
        self._inputs = {i.name for i in self._session.get_inputs()}
        outputs = [o.name for o in self._session.get_outputs()]
        self._output = "sentence_embedding" if "sentence_embedding" in outputs else outputs[0]
        self._pool = self._output != "sentence_embedding"
        shape = self._session.get_outputs()[outputs.index(self._output)].shape
        self.dim = int(shape[-1])
        self.parallel_runs = max(1, parallel_runs)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.parallel_runs, thread_name_prefix="ort"
        )

    async def check_ready(self) -> None:
        """In process: ready once the session is built."""

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(input_ids)
        (result,) = self._session.run([self._output], feeds)
        if self._pool:
            return mean_pool_normalise(result, attention_mask)
        return normalise(result)

    async def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run, input_ids, attention_mask)

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
