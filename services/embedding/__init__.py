"""The embedding service."""
