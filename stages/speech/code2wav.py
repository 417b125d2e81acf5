"""Codec frames -> PCM for the speech pipeline, behind one small interface (:class:`Vocoder`).

The pipeline opens a stream per request, pushes each codec frame as the talker makes it, and
once per tick pulls the audio that is due. Two implementations:

* :class:`StreamingVocoder` (the default): ``omnirt.codecs.code2wav``'s exact streaming decoder,
  one batched step per tick for every stream with a new frame; output equals the offline
  decode. Audio is handed out in chunks of ``first_chunk`` then ``chunk`` frames. On CUDA the
  step replays a CUDA graph captured at start-up (``graphs=True``, the default), bitwise the
  same PCM as the eager step.
* :class:`ChunkedVocoder`: transformers' ``Qwen3OmniMoeCode2Wav`` re-run on
  each chunk with up to ``left_context`` earlier frames (its ``chunked_decode`` scheme). Each decode of
  frames ``[w, e)`` gives the causal waveform up to ``e * upsample - tail`` samples; the stream
  emits from where the last chunk stopped, so the output is gapless and equal to one full
  decode while the whole history fits in the left context.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from ..graphs import CudaGraphRunner


class Vocoder(Protocol):
    def open(self, key: str) -> None:
        """Starts an empty stream (raises ``ValueError`` when none is free)."""
        ...

    def push(self, key: str, frame: torch.Tensor) -> None:
        """Queues one frame of codes ``[num_quantizers]``."""
        ...

    def pull(self, finishing: Collection[str]) -> dict[str, tuple[np.ndarray, int]]:
        """Decodes what is queued; returns ``key -> (float32 PCM, frames it covers)`` for the
        streams whose chunk is due, and everything left of the streams in ``finishing``."""
        ...

    def close(self, key: str) -> None:
        """Drops a stream (finished or cancelled) and frees its state."""
        ...


class _Chunking:
    def __init__(self, first_chunk: int, chunk: int) -> None:
        self.first_chunk = first_chunk
        self.chunk = chunk

    def due(self, sent_frames: int, ready_frames: int) -> bool:
        want = self.first_chunk if sent_frames == 0 else self.chunk
        return ready_frames - sent_frames >= want


class StreamingVocoder(_Chunking):
    """Exact streaming code2wav, batched across streams (``omnirt.codecs.code2wav``).

    With ``graphs`` (the default) on a CUDA module a step runs the first rows of the pool up to
    the smallest of ``buckets`` (default: the whole pool of ``max_streams``) that covers the
    highest stream with a frame; it captures one CUDA graph of that step per bucket at
    construction (``stages/graphs.py``: warm-up and capture on idle rows, no stream's state
    moves) and replays them on every tick; the PCM equals the eager step's bitwise at the same
    bucket. Slots are handed out lowest first, and when a stream closes the highest ones move
    down into free slots while that lowers the bucket (``Code2WavStreamer.compact``). Eager
    (off CUDA, or ``graphs=False``) a step gathers just the streams with a frame, so held or
    finished streams in any slot cost nothing.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        max_streams: int,
        first_chunk: int = 2,
        chunk: int = 6,
        graphs: bool = True,
        buckets: Sequence[int] | None = None,
    ) -> None:
        super().__init__(first_chunk, chunk)
        from omnirt.codecs.code2wav import Code2WavStreamer

        param = next(module.parameters())
        graphed = graphs and param.device.type == "cuda"
        self.streamer = Code2WavStreamer(
            module,
            max_slots=max_streams,
            device=param.device,
            dtype=param.dtype,
            buckets=buckets,
            gather=not graphed,
        )
        if graphed:
            pool = self.streamer.pool
            # The streamer indexes the rows it needs out of the output (a copy), so the
            # runner can hand out views of its static output buffer.
            runner = CudaGraphRunner(
                pool.step_io, pool.make_inputs, buckets=self.streamer.buckets, clone_outputs=False
            )
            with torch.cuda.device(param.device):
                runner.capture()
            self.streamer.runner = runner
        self._slot: dict[str, int] = {}
        self._queued: dict[str, list[torch.Tensor]] = {}
        self._pcm: dict[str, list[np.ndarray]] = {}
        self._decoded: dict[str, int] = {}
        self._sent: dict[str, int] = {}

    def open(self, key: str) -> None:
        self._slot[key] = self.streamer.acquire()
        self._queued[key], self._pcm[key] = [], []
        self._decoded[key] = self._sent[key] = 0

    def push(self, key: str, frame: torch.Tensor) -> None:
        self._queued[key].append(frame)

    def pull(self, finishing: Collection[str]) -> dict[str, tuple[np.ndarray, int]]:
        while True:
            batch = {k: q.pop(0) for k, q in self._queued.items() if q}
            if not batch:
                break
            pcm = self.streamer.step({self._slot[k]: codes for k, codes in batch.items()})
            for k in batch:
                self._pcm[k].append(pcm[self._slot[k]])
                self._decoded[k] += 1
        out: dict[str, tuple[np.ndarray, int]] = {}
        for k, pieces in self._pcm.items():
            if pieces and (k in finishing or self.due(self._sent[k], self._decoded[k])):
                out[k] = (np.concatenate(pieces), self._decoded[k] - self._sent[k])
                self._pcm[k] = []
                self._sent[k] = self._decoded[k]
        return out

    def close(self, key: str) -> None:
        slot = self._slot.pop(key, None)
        if slot is not None:
            self.streamer.release(slot)
            moves = self.streamer.compact()
            if moves:
                at = {s: k for k, s in self._slot.items()}
                for source, target in moves:
                    k = at.pop(source)
                    self._slot[k], at[target] = target, k
        for d in (self._queued, self._pcm, self._decoded, self._sent):
            d.pop(key, None)


class ChunkedVocoder(_Chunking):
    """Re-decodes each chunk with left context through transformers' ``Qwen3OmniMoeCode2Wav``."""

    def __init__(
        self, module: nn.Module, *, first_chunk: int = 4, chunk: int = 12, left_context: int = 25
    ) -> None:
        super().__init__(first_chunk, chunk)
        self.module = module
        self.upsample = int(module.total_upsample)
        self.left_context = left_context
        q = int(module.config.num_quantizers)
        with torch.no_grad():
            probe = torch.zeros(1, q, 2, dtype=torch.long, device=next(module.parameters()).device)
            self.tail = 2 * self.upsample - int(module(probe).shape[-1])
        self._streams: dict[str, _ContextStream] = {}

    def open(self, key: str) -> None:
        self._streams[key] = _ContextStream()

    def push(self, key: str, frame: torch.Tensor) -> None:
        s = self._streams[key]
        s.codes.append(frame)
        s.frames += 1

    def pull(self, finishing: Collection[str]) -> dict[str, tuple[np.ndarray, int]]:
        out: dict[str, tuple[np.ndarray, int]] = {}
        for key, s in self._streams.items():
            if s.frames > s.decoded and (key in finishing or self.due(s.decoded, s.frames)):
                before = s.decoded
                out[key] = (self._decode(s), s.decoded - before)
        return out

    def close(self, key: str) -> None:
        self._streams.pop(key, None)

    @torch.no_grad()
    def _decode(self, s: _ContextStream) -> np.ndarray:
        end = s.frames
        start = max(0, s.decoded - self.left_context)
        codes = torch.stack(s.codes[start - s.first :], dim=-1).unsqueeze(0)  # [1, Q, n]
        wav = self.module(codes)[0, 0]
        stop = end * self.upsample - self.tail
        piece = wav[s.emitted - start * self.upsample : stop - start * self.upsample]
        s.emitted, s.decoded = stop, end
        drop = max(0, end - self.left_context) - s.first  # frames no later chunk reads
        if drop > 0:
            del s.codes[:drop]
            s.first += drop
        return piece.float().cpu().numpy()


class _ContextStream:
    def __init__(self) -> None:
        self.codes: list[torch.Tensor] = []
        self.first = 0  # absolute index of ``codes[0]``
        self.frames = 0
        self.decoded = 0
        self.emitted = 0  # samples


def make_vocoder(
    module: nn.Module,
    kind: str,
    *,
    max_streams: int,
    graphs: bool = True,
    buckets: Sequence[int] | None = None,
) -> Vocoder:
    """``kind``: "stream" (the exact streaming decoder), "chunked" (transformers' module re-run on
    chunks), or "auto": the streaming decoder, on every device. On CPU it steps just the streams
    with a frame, about a millisecond each per tick at 8 or more (4.5 ms for one) with the
    embedded default, evenly; the chunked one costs more in all (left context decoded again
    with each chunk: 20 ms per chunk of 12 frames) and comes in bursts, every stream due in the
    same tick decoded in it, and is exact only while a reply's history fits its left context.
    ``graphs``: the streaming decoder replays a CUDA graph of its step on CUDA (see
    :class:`StreamingVocoder`) per row bucket of ``buckets``; the chunked one has none."""
    if kind == "auto":
        kind = "stream"
    if kind == "stream":
        return StreamingVocoder(module, max_streams=max_streams, graphs=graphs, buckets=buckets)
    if kind == "chunked":
        return ChunkedVocoder(module)
    raise ValueError(f"unknown vocoder {kind!r} (stream, chunked or auto)")
