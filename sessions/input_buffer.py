"""The input audio buffer: wire audio appended by the client, decoded to float32 24 kHz.

Samples are addressed by their index in the session's audio (``start``/``end``: every decoded
sample since the session began, committed or not), which is the clock of server VAD events.
"""

from __future__ import annotations

import numpy as np
from omnirt.codecs.audio import SAMPLE_RATE, AudioDecoder, FormatType, bytes_per_ms, check_wire_bytes

from .errors import ErrorCode, SessionError

#: A commit of less audio than this is refused (``input_audio_buffer_commit_empty``).
MIN_COMMIT_MS = 100
#: Bytes per ms of 24 kHz PCM16, the unit the buffer limit counts in.
_PCM_BYTES_PER_MS = bytes_per_ms("audio/pcm")



def check_audio_bytes(data: bytes, fmt: FormatType) -> None:
    """Appended audio must be whole samples of ``fmt``: else ``invalid_value`` (param ``audio``)."""
    try:
        check_wire_bytes(data, fmt)
    except ValueError:
        raise SessionError(
            ErrorCode.INVALID_VALUE,
            f"audio/pcm audio must be whole 16-bit samples; got {len(data)} bytes (odd).",
            "audio",
        ) from None

class InputAudioBuffer:
    def __init__(self, fmt: FormatType, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._decoder = AudioDecoder(fmt)
        self._chunks: list[np.ndarray] = []
        #: Wire bytes appended since the last commit/clear (in the format they came in).
        self._wire_ms = 0.0
        #: Session sample index of the first held sample, and one past the last decoded one.
        self.start = 0
        self.end = 0

    @property
    def format(self) -> FormatType:
        return self._decoder.format

    def set_format(self, fmt: FormatType) -> None:
        """Later appends use ``fmt``; audio already buffered stays."""
        if fmt != self._decoder.format:
            self._flush_decoder()
            self._decoder = AudioDecoder(fmt)

    def _flush_decoder(self) -> None:
        """Buffer what the decoder still holds (the resampler's tail)."""
        tail = self._decoder.flush()
        self._chunks.append(tail)
        self.end += len(tail)

    @property
    def duration_ms(self) -> float:
        return self._wire_ms

    @property
    def held_bytes(self) -> int:
        """What the buffer holds, counted as bytes of 24 kHz PCM16."""
        return int(self._wire_ms * _PCM_BYTES_PER_MS)

    def append(self, data: bytes) -> np.ndarray:
        """Decode and buffer ``data``; returns the new 24 kHz samples. On error nothing changes."""
        fmt = self._decoder.format
        check_audio_bytes(data, fmt)
        ms = len(data) / bytes_per_ms(fmt)
        added = int(ms * _PCM_BYTES_PER_MS)
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
        self.end += len(samples)
        return samples

    @staticmethod
    def ms_to_sample(ms: float) -> int:
        return int(ms * SAMPLE_RATE // 1000)

    @property
    def end_ms(self) -> int:
        """Session audio time (ms) at the end of what was appended."""
        return self.end * 1000 // SAMPLE_RATE

    @property
    def start_ms(self) -> int:
        return -(-self.start * 1000 // SAMPLE_RATE)

    def _held(self) -> np.ndarray:
        if len(self._chunks) != 1:
            self._chunks = [np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)]
        return self._chunks[0]

    def drop_before(self, sample: int) -> None:
        """Forget held audio before session sample ``sample`` (server VAD trims silence)."""
        n = min(sample, self.end) - self.start
        if n <= 0:
            return
        chunks, left, whole = self._chunks, n, 0  # whole chunks go; the next one is cut (no copy)
        while whole < len(chunks) and len(chunks[whole]) <= left:
            left -= len(chunks[whole])
            whole += 1
        del chunks[:whole]
        if left:
            chunks[0] = chunks[0][left:]
        self.start += n
        self._wire_ms = max(0.0, self._wire_ms - n * 1000 / SAMPLE_RATE)

    def take(self, start: int, end: int) -> np.ndarray:
        """The held audio of session samples ``[start, end)`` (clipped to what is held); everything
        before ``end`` is then dropped. Nothing is flushed: the stream goes on."""
        held = self._held()
        lo = max(start, self.start) - self.start
        hi = max(min(end, self.end) - self.start, lo)
        audio = held[lo:hi].astype(np.float32, copy=True)
        self.drop_before(end)
        return audio

    def commit(self) -> np.ndarray:
        """Take everything buffered (float32, 24 kHz) and empty the buffer."""
        if self._wire_ms < MIN_COMMIT_MS:
            raise SessionError(
                ErrorCode.COMMIT_EMPTY,
                f"Error committing input audio buffer: buffer too small. Expected at least "
                f"{MIN_COMMIT_MS}ms of audio, but buffer only has {self._wire_ms:.2f}ms of audio.",
            )
        self._flush_decoder()
        audio = np.concatenate(self._chunks).astype(np.float32, copy=False)
        self.clear()
        return audio

    def clear(self) -> None:
        self._chunks = []
        self._wire_ms = 0.0
        self._decoder = AudioDecoder(self._decoder.format)
        self.start = self.end
