"""The generation service."""
