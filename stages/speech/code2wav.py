"""Codec frames -> PCM for the speech pipeline, behind one small interface (:class:`Vocoder`).

The pipeline opens a stream per request, pushes each codec frame as the talker makes it, and
once per tick pulls the audio that is due. Two implementations:

* :class:`StreamingVocoder` (the default): ``omnirt.codecs.code2wav``'s exact streaming decoder;
  output equals the offline decode. When a stream's chunk is due (``first_chunk`` then
  ``chunk`` frames) one batched step of several frames decodes what every stream has queued,
  and each hands its audio out. On CUDA the step replays a CUDA graph captured at start-up
  (``graphs=True``, the default), bitwise the same PCM as the eager step.
* :class:`ChunkedVocoder`: transformers' ``Qwen3OmniMoeCode2Wav`` re-run on
  each chunk with up to ``left_context`` earlier frames (its ``chunked_decode`` scheme). Each decode of
  frames ``[w, e)`` gives the causal waveform up to ``e * upsample - tail`` samples; the stream
  emits from where the last chunk stopped, so the output is gapless and equal to one full
  decode while the whole history fits in the left context.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from ..graphs import CudaGraphRunner

if TYPE_CHECKING:
    from omnirt.codecs.code2wav import Code2WavStreamer


class Vocoder(Protocol):
    def open(self, key: str) -> None:
        """Starts an empty stream (raises ``ValueError`` when none is free)."""
        ...

    def push(self, key: str, frame: torch.Tensor) -> None:
        """Queues one frame of codes ``[num_quantizers]``."""
        ...

    def pull(self, finishing: Collection[str]) -> dict[str, tuple[np.ndarray, int]]:
        """Decodes what is queued once some stream's chunk is due or a stream of ``finishing``
        has frames left; returns ``key -> (float32 PCM, frames it covers)`` for the streams whose
        audio it decoded (every stream of ``finishing`` with frames left among them)."""
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

    Frames queue up per stream, and a :meth:`pull` decodes only when some stream's chunk is due
    (``first_chunk`` frames, then ``chunk``) or a finishing stream has frames left: then one
    step decodes the due streams' frames, with graphs (``share_runs``) as many of every other
    stream's queued frames too, and hands the new audio out (a new reply's first chunk is a
    step of ``first_chunk`` frames, however many the playing replies have queued). On a GPU a
    step of several frames costs little more than one (a few hundred kernels' launches: at the
    published size, 8 streams, an H100, 8.1 ms for 6 frames each against 3.8 ms for one), so the
    vocoder runs about once a chunk, not once a frame; and since graphed streams decode together,
    those that play together fall into step and share the runs. Eager steps (CPU) gather the
    rows they decode, so there each stream decodes its own chunks, at its own ticks (the work
    spreads over the ticks). A first audio is handed out once its whole first chunk is decoded
    (or its stream finishes), later audio as soon as it is decoded. A pull that decodes nothing
    costs nothing.

    With ``graphs`` (the default) on a CUDA module a step runs the first rows of the pool up to
    the smallest of ``buckets`` (default: the whole pool of ``max_streams``) that covers the
    highest stream with frames, and ``first_chunk`` or ``chunk`` frames (the smaller that holds
    the most a stream has queued); it captures one CUDA graph of that step per row bucket and
    frame count at construction (``stages/graphs.py``: warm-up and capture on idle rows, no
    stream's state moves) and replays them; the PCM equals the eager step's bitwise at the same
    buckets. Slots are handed out lowest first, and when a stream closes the highest ones move
    down into free slots while that lowers the bucket (``Code2WavStreamer.compact``). Eager
    (off CUDA, or ``graphs=False``) a step gathers just the streams with frames, so held or
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
        if not 1 <= first_chunk <= chunk:
            raise ValueError(
                f"vocoder chunks must satisfy 1 <= first_chunk <= chunk, got {first_chunk}, {chunk}"
            )
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
            step_buckets=(first_chunk, chunk),
        )
        if graphed:
            for steps in self.streamer.step_buckets:
                self.streamer.runners[steps] = capture_step_graphs(self.streamer, steps)
        #: Whether a run takes every stream's queued frames along, not just the due streams':
        #: graphed steps compute every row of their bucket anyway, so sharing the runs is free;
        #: eager steps gather the rows they decode, so others' frames would only lengthen the tick.
        self.share_runs = graphed
        self._slot: dict[str, int] = {}
        self._queued: dict[str, list[torch.Tensor]] = {}
        self._sent: dict[str, int] = {}
        #: PCM decoded and not handed out yet, and the frames it covers, per stream.
        self._held: dict[str, tuple[list[np.ndarray], int]] = {}

    def open(self, key: str) -> None:
        self._slot[key] = self.streamer.acquire()
        self._queued[key] = []
        self._sent[key] = 0
        self._held[key] = ([], 0)

    def push(self, key: str, frame: torch.Tensor) -> None:
        self._queued[key].append(frame)

    def pull(self, finishing: Collection[str]) -> dict[str, tuple[np.ndarray, int]]:
        queued, sent, held = self._queued, self._sent, self._held
        due = [
            k
            for k, q in queued.items()
            if (q or held[k][1]) and (k in finishing or self.due(sent[k], sent[k] + held[k][1] + len(q)))
        ]
        # Shared runs: every stream's frames go along, up to the due streams' count.
        taking = (list(queued) if due else []) if self.share_runs else due
        take = min(self.chunk, max((len(queued[k]) for k in due), default=0))  # 0: only held audio is due
        while take and (batch := {k: queued[k][:take] for k in taking if queued[k]}):
            pcm = self.streamer.step({self._slot[k]: torch.stack(codes) for k, codes in batch.items()})
            for k, codes in batch.items():
                self._hold(k, pcm[self._slot[k]], len(codes))
                del queued[k][: len(codes)]
            if not any(queued[k] for k in due):
                break
        # a first audio waits for its whole first chunk
        return self._hand_out(lambda k, frames: bool(sent[k]) or k in finishing or frames >= self.first_chunk)

    def _hold(self, key: str, pcm: np.ndarray, frames: int) -> None:
        """Keeps ``frames`` frames' decoded ``pcm`` of a stream until :meth:`_hand_out`."""
        pieces, held = self._held[key]
        self._held[key] = ([*pieces, pcm], held + frames)

    def _hand_out(self, ready: Callable[[str, int], bool]) -> dict[str, tuple[np.ndarray, int]]:
        """The held audio, and the frames it covers, of every stream for which ``ready(key,
        frames)`` holds; those streams' audio counts as sent."""
        out: dict[str, tuple[np.ndarray, int]] = {}
        for k, (pieces, frames) in self._held.items():
            if frames and ready(k, frames):
                out[k] = (np.concatenate(pieces), frames)
                self._sent[k] += frames
                self._held[k] = ([], 0)
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
        for d in (self._queued, self._sent, self._held):
            d.pop(key, None)


def capture_step_graphs(streamer: Code2WavStreamer, steps: int) -> CudaGraphRunner:
    """The CUDA graphs of a ``Code2WavStreamer``'s step of ``steps`` frames, one per row bucket,
    captured (on the pool's device): what ``streamer.runners[steps]`` takes."""
    pool = streamer.pool
    # The streamer indexes the rows it needs out of the output (a copy), so the runner can hand
    # out views of its static output buffer.
    runner = CudaGraphRunner(
        pool.step_io,
        functools.partial(pool.make_inputs, steps=steps),
        buckets=streamer.buckets,
        clone_outputs=False,
    )
    with torch.cuda.device(pool.device):
        runner.capture()
    return runner


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
