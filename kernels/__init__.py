"""Triton kernels, each with a torch reference path (``ring_attention``: Mimi's KV-ring attention)."""
