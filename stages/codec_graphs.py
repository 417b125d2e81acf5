"""CUDA graphs for the streaming codecs' one-frame steps.

Codecs expose their steps in the form :class:`~omnirt.stages.graphs.CudaGraphRunner` captures
(a dict of tensors in, a dict out, example inputs per batch size) and never import ``stages``;
this module swaps a codec pool's eager runners for graph runners of the same signature.
"""

from __future__ import annotations

import torch

from ..codecs.mimi.pool import MimiSlotPool
from .graphs import CudaGraphRunner


def capture_mimi(pool: MimiSlotPool, *, enabled: bool = True, graph_pool: object | None = None) -> None:
    """Captures ``pool``'s one-frame encode and decode at each of its buckets and makes them its
    runners (a batch without a captured bucket, or any other shape, still runs eagerly).
    Nothing happens off CUDA or with ``enabled`` false."""
    if not enabled or pool.device.type != "cuda":
        return
    encode = CudaGraphRunner(pool.encode_io, pool.encode_inputs, pool.buckets, pool=graph_pool)
    decode = CudaGraphRunner(pool.decode_io, pool.decode_inputs, pool.buckets, pool=graph_pool)
    with torch.cuda.device(pool.device):
        encode.capture()
        decode.capture()
    pool.encode_runner, pool.decode_runner = encode, decode
