"""The rerank service."""
