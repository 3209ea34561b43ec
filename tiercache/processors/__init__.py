"""Processors: layers that wrap a layer (``quantize``, ``offload``)."""
