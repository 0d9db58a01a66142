"""The budget service."""
