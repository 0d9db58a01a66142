"""ragline shared library: contracts (ragline.v1), service kit, clients."""

__version__ = "0.3.0"
