"""Triton python-backend model: a sentence-embedding ONNX graph run with ONNX Runtime.

Runs inside Triton's python stub (its own interpreter and virtualenv), so it imports only
numpy, onnxruntime and Triton's utils. Accepts graphs that output `sentence_embedding`
(pooled + normalised) or `last_hidden_state` (pooled and normalised here).
"""

import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self.pool = "sentence_embedding" not in outputs
        self.output = outputs[0] if self.pool else "sentence_embedding"

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            feeds = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in self.inputs:
                feeds["token_type_ids"] = np.zeros_like(ids)
            result = self.session.run([self.output], feeds)[0]
            if self.pool:
                weights = mask[..., None].astype(result.dtype)
                result = (result * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
            norms = np.clip(np.linalg.norm(result, axis=1, keepdims=True), 1e-12, None)
            vectors = (result / norms).astype(np.float32)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("sentence_embedding", vectors)])
            )
        return responses
