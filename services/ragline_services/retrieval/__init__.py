"""The retrieval service."""
