"""The byte protocol between the server and its VAD process (:mod:`.process`), over two sockets.

Server -> VAD process, one frame per message: a header ``<B I I d`` (op, stream or token,
payload bytes, arrival time) and the payload.

- ``OPEN`` stream: a new stream with fresh model state; an optional payload (``<I``) is the index
  of its first window (a stream reopened after the VAD process was replaced).
- ``AUDIO`` stream: float32 samples at 24 kHz; ``arrived`` is the server's ``perf_counter``
  when the chunk reached the session, echoed back with every window the chunk completes.
- ``CLOSE`` stream: forget the stream.
- ``SYNC`` token: answered with ``SYNCED`` token once everything sent before it is scored.

VAD process -> server: a header ``<B I I I d`` (op, count or token, batches, payload bytes,
busy seconds) and the payload.

- ``READY``: the model loaded and ran once. ``FAILED``: it did not; the payload is the reason
  (UTF-8), and the process exits.
- ``RESULTS``: ``count`` records of :data:`RESULT` (stream, window index, probability, the
  arrival time of the chunk that completed the window); ``batches`` model calls taking
  ``busy`` seconds since the last ``RESULTS``.
- ``SYNCED`` token.
"""

from __future__ import annotations

import struct

import numpy as np

TO_VAD = struct.Struct("<BIId")
FROM_VAD = struct.Struct("<BIIId")

OPEN, AUDIO, CLOSE, SYNC = 1, 2, 3, 4
READY, FAILED, RESULTS, SYNCED = 1, 2, 3, 4

RESULT = np.dtype([("stream", "<u4"), ("index", "<u4"), ("prob", "<f4"), ("arrived", "<f8")])


def to_vad(op: int, stream: int, payload: bytes = b"", arrived: float = 0.0) -> bytes:
    return TO_VAD.pack(op, stream, len(payload), arrived) + payload


def from_vad(op: int, arg: int = 0, payload: bytes = b"", batches: int = 0, busy: float = 0.0) -> bytes:
    return FROM_VAD.pack(op, arg, batches, len(payload), busy) + payload


class FrameReader:
    """Splits a byte stream into ``(header fields, payload)`` frames of one header layout (in both
    layouts the payload length is the next-to-last header field)."""

    def __init__(self, header: struct.Struct) -> None:
        self._header = header
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[tuple, bytes]]:
        self._buffer += data
        frames = []
        at = 0
        buffer, header = self._buffer, self._header
        while len(buffer) - at >= header.size:
            fields = header.unpack_from(buffer, at)
            end = at + header.size + fields[-2]
            if end > len(buffer):
                break
            frames.append((fields, bytes(buffer[at + header.size : end])))
            at = end
        if at:
            del buffer[:at]
        return frames
