"""The HTTP gateway: the OpenAI-compatible API and JSON for the public gRPC surface."""
