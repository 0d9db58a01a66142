"""Python-backend stand-in for TensorRT-LLM's `preprocessing` model (tests only)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            queries = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)
            ids, lengths = [], []
            for query in queries:
                text = query.decode() if isinstance(query, bytes) else str(query)
                words = text.split()
                ids.append([hash(w) % 32000 for w in words] or [0])
                lengths.append(len(words))
            width = max(len(row) for row in ids)
            padded = np.array([row + [0] * (width - len(row)) for row in ids], dtype=np.int32)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("INPUT_ID", padded),
                        pb_utils.Tensor(
                            "REQUEST_INPUT_LEN", np.array(lengths, dtype=np.int32)[:, None]
                        ),
                    ]
                )
            )
        return responses
