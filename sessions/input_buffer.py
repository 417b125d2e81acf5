"""The input audio buffer: wire audio appended by the client, decoded to float32 24 kHz."""

from __future__ import annotations

import numpy as np
from omnirt.codecs.audio import SAMPLE_RATE, AudioDecoder, FormatType, bytes_per_ms

from .errors import ErrorCode, SessionError

#: A commit of less audio than this is refused (``input_audio_buffer_commit_empty``).
MIN_COMMIT_MS = 100


class InputAudioBuffer:
    def __init__(self, fmt: FormatType, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._decoder = AudioDecoder(fmt)
        self._chunks: list[np.ndarray] = []
        #: Wire bytes appended since the last commit/clear (in the format they came in).
        self._wire_ms = 0.0

    @property
    def format(self) -> FormatType:
        return self._decoder.format

    def set_format(self, fmt: FormatType) -> None:
        """Later appends use ``fmt``; audio already buffered stays."""
        if fmt != self._decoder.format:
            self._chunks.append(self._decoder.flush())
            self._decoder = AudioDecoder(fmt)

    @property
    def duration_ms(self) -> float:
        return self._wire_ms

    @property
    def held_bytes(self) -> int:
        """What the buffer holds, counted as bytes of 24 kHz PCM16."""
        return int(self._wire_ms * SAMPLE_RATE * 2 / 1000)

    def append(self, data: bytes) -> np.ndarray:
        """Decode and buffer ``data``; returns the new 24 kHz samples. On error nothing changes."""
        fmt = self._decoder.format
        if fmt == "audio/pcm" and len(data) % 2:
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                f"audio/pcm audio must be whole 16-bit samples; got {len(data)} bytes (odd).",
                "audio",
            )
        ms = len(data) / bytes_per_ms(fmt)
        added = int(ms * SAMPLE_RATE * 2 / 1000)
        if self.held_bytes + added > self.max_bytes:
            raise SessionError(
                ErrorCode.INPUT_BACKPRESSURE,
                f"The input audio buffer would exceed {self.max_bytes} bytes "
                f"({self.max_bytes // (SAMPLE_RATE * 2)} s); commit or clear it first.",
                "audio",
            )
        samples = self._decoder.decode(data)
        self._chunks.append(samples)
        self._wire_ms += ms
        return samples

    def commit(self) -> np.ndarray:
        """Take everything buffered (float32, 24 kHz) and empty the buffer."""
        if self._wire_ms < MIN_COMMIT_MS:
            raise SessionError(
                ErrorCode.COMMIT_EMPTY,
                f"Error committing input audio buffer: buffer too small. Expected at least "
                f"{MIN_COMMIT_MS}ms of audio, but buffer only has {self._wire_ms:.2f}ms of audio.",
            )
        self._chunks.append(self._decoder.flush())
        audio = np.concatenate(self._chunks).astype(np.float32, copy=False)
        self.clear()
        return audio

    def clear(self) -> None:
        self._chunks = []
        self._wire_ms = 0.0
        self._decoder = AudioDecoder(self._decoder.format)
