"""Decoupled python-backend stand-in for a TensorRT-LLM ensemble (tests only).

For each request it streams `max_tokens` pieces (" " + the prompt's words in a cycle),
one every `step_delay_s`, stops early when the request is cancelled, and closes the stream
with the COMPLETE_FINAL flag. With stream=false it sends the whole text in one response.
"""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json

        config = json.loads(args["model_config"])
        self.delay = float(config["parameters"]["step_delay_s"]["string_value"])
        self.workers = []

    def execute(self, requests):
        for request in requests:
            worker = threading.Thread(target=self._generate, args=(request,), daemon=True)
            worker.start()
            self.workers.append(worker)
        return None

    def _generate(self, request):
        sender = request.get_response_sender()
        prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
        text = prompt.reshape(-1)[0]
        text = text.decode() if isinstance(text, bytes) else str(text)
        max_tokens = int(
            pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0]
        )
        stream_tensor = pb_utils.get_input_tensor_by_name(request, "stream")
        streaming = bool(stream_tensor.as_numpy().reshape(-1)[0]) if stream_tensor else False
        words = text.split() or ["."]
        pieces = []
        for step in range(max_tokens):
            if request.is_cancelled():
                break
            time.sleep(self.delay)
            piece = " " + words[step % len(words)]
            pieces.append(piece)
            if streaming:
                sender.send(self._response(piece))
        if not streaming and not request.is_cancelled():
            sender.send(self._response("".join(pieces)))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _response(text):
        tensor = pb_utils.Tensor("text_output", np.array([[text.encode()]], dtype=np.object_))
        return pb_utils.InferenceResponse(output_tensors=[tensor])

    def finalize(self):
        for worker in self.workers:
            worker.join(timeout=1)
