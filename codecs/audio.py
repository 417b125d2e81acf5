"""PCM sample conversions, base64, G.711 (mu-law / A-law) and resampling, all in numpy.

Everything inside the server is mono PCM at 24 kHz (float32 in [-1, 1] towards the models, int16
towards the wire). The wire formats are ``audio/pcm`` (PCM16 little-endian, 24 kHz) and the two
G.711 formats ``audio/pcmu`` / ``audio/pcma`` (8 kHz, one byte per sample).
"""

from __future__ import annotations

import base64
import binascii
from typing import Literal

import numpy as np
import soxr

SAMPLE_RATE = 24_000
G711_RATE = 8_000

FormatType = Literal["audio/pcm", "audio/pcmu", "audio/pcma"]


# -- PCM16 <-> float ------------------------------------------------------------------------------
_INV_32768 = np.float32(1 / 32768)


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian PCM16 bytes to float32 in [-1, 1). ``len(data)`` must be even."""
    if len(data) % 2:
        raise ValueError("PCM16 audio must hold whole 2-byte samples")
    return int16_to_float(np.frombuffer(data, dtype="<i2"))


def int16_to_float(x: np.ndarray) -> np.ndarray:
    """int16 samples to float32 in [-1, 1): one pass, one array (x * 2**-15 is exact, the same
    as x / 32768)."""
    return np.multiply(x, _INV_32768, dtype=np.float32)


def float_to_int16(x: np.ndarray) -> np.ndarray:
    return (np.clip(np.asarray(x, dtype=np.float32), -1.0, 32767 / 32768) * 32768.0).round().astype(np.int16)


def float_to_pcm16(x: np.ndarray) -> bytes:
    return float_to_int16(x).astype("<i2").tobytes()


def int16_to_pcm16(x: np.ndarray) -> bytes:
    return np.asarray(x, dtype=np.int16).astype("<i2").tobytes()


# -- base64 ---------------------------------------------------------------------------------------
def b64decode(text: str) -> bytes:
    """Strict base64 (standard alphabet, padding required); raises ``ValueError``.

    Fast path (every audio chunk comes through here): the lenient decoder skips characters
    outside the alphabet and stops at padding, so its output has exactly 3 bytes per 4
    characters, less the padding, only when it skipped nothing, which is when the text is valid
    strict base64. Anything else is decoded strictly for the precise error."""
    try:
        data = binascii.a2b_base64(text)
    except (binascii.Error, ValueError):
        data = None
    n = len(text)
    if data is not None and n % 4 == 0 and len(data) == n // 4 * 3 - text.endswith("=") - text.endswith("=="):
        return data
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"invalid base64: {exc}") from None


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# -- G.711 ----------------------------------------------------------------------------------------
_MULAW_BIAS = 0x84
_MULAW_CLIP = 8159  # on 14-bit magnitudes


def mulaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples to G.711 mu-law bytes (the CCITT reference coder, as audioop.lin2ulaw)."""
    x = np.asarray(pcm, dtype=np.int32) >> 2  # 14-bit
    mask = np.where(x < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(x), _MULAW_CLIP) + (_MULAW_BIAS >> 2)
    seg = np.maximum(np.floor(np.log2(mag)).astype(np.int32) - 5, 0)
    uval = np.where(seg >= 8, 0x7F, (seg << 4) | ((mag >> (np.minimum(seg, 7) + 1)) & 0x0F))
    return ((uval ^ mask) & 0xFF).astype(np.uint8).tobytes()


def _mulaw_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    mag = (((mantissa << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return np.where(sign != 0, -mag, mag).astype(np.int16)


def alaw_encode(pcm: np.ndarray) -> bytes:
    """int16 samples to G.711 A-law bytes (as in audioop.lin2alaw)."""
    x = np.asarray(pcm, dtype=np.int32) >> 3  # A-law works on 13-bit magnitudes
    sign = np.where(x >= 0, 0x80, 0).astype(np.int32)
    mag = np.where(x >= 0, x, -x - 1)
    mag = np.minimum(mag, 0x0FFF)
    exponent = np.where(mag < 0x20, 0, np.floor(np.log2(np.maximum(mag, 1))).astype(np.int32) - 4)
    exponent = np.clip(exponent, 0, 7)
    mantissa = np.where(exponent == 0, mag >> 1, mag >> exponent) & 0x0F
    return (((sign | (exponent << 4) | mantissa) ^ 0x55) & 0xFF).astype(np.uint8).tobytes()


def _alaw_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    sign = a & 0x80
    exponent = (a >> 4) & 0x07
    mantissa = a & 0x0F
    mag = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0)
    )
    return np.where(sign != 0, mag, -mag).astype(np.int16)


_MULAW_DECODE = _mulaw_table()
_ALAW_DECODE = _alaw_table()


def mulaw_decode(data: bytes) -> np.ndarray:
    return _MULAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def alaw_decode(data: bytes) -> np.ndarray:
    return _ALAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


# -- resampling -----------------------------------------------------------------------------------
def resample(x: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    """Whole-signal resampling (float32 mono)."""
    x = np.asarray(x, dtype=np.float32)
    if in_rate == out_rate or x.size == 0:
        return x
    return soxr.resample(x, in_rate, out_rate, quality="HQ").astype(np.float32, copy=False)


class StreamResampler:
    """Resamples one stream chunk by chunk, keeping the filter state between chunks."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32")
        )

    def process(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if self._stream is None:
            return x
        return self._stream.resample_chunk(x, last=last)

    def flush(self) -> np.ndarray:
        return self.process(np.zeros(0, dtype=np.float32), last=True)


# -- wire formats ---------------------------------------------------------------------------------
def bytes_per_ms(fmt: FormatType) -> int:
    return SAMPLE_RATE * 2 // 1000 if fmt == "audio/pcm" else G711_RATE // 1000


def wire_rate(fmt: FormatType) -> int:
    return SAMPLE_RATE if fmt == "audio/pcm" else G711_RATE


def check_wire_bytes(data: bytes, fmt: FormatType) -> None:
    """Raises ``ValueError`` unless ``data`` holds whole samples of ``fmt``."""
    if fmt == "audio/pcm" and len(data) % 2:
        raise ValueError("audio/pcm data must hold whole 16-bit samples (an even byte count)")


def wire_to_samples(data: bytes, fmt: FormatType) -> np.ndarray:
    """Wire bytes to float32 at the format's own rate."""
    if fmt == "audio/pcm":
        return pcm16_to_float(data)
    samples = mulaw_decode(data) if fmt == "audio/pcmu" else alaw_decode(data)
    return int16_to_float(samples)


def decode_audio(data: bytes, fmt: FormatType) -> np.ndarray:
    """Whole wire audio to float32 mono at 24 kHz."""
    check_wire_bytes(data, fmt)
    return resample(wire_to_samples(data, fmt), wire_rate(fmt), SAMPLE_RATE)


def encode_audio(pcm24k: np.ndarray, fmt: FormatType) -> bytes:
    """Whole int16 24 kHz audio to wire bytes of ``fmt``."""
    return AudioEncoder(fmt).encode(pcm24k, last=True)


class AudioDecoder:
    """Streaming wire -> float32 24 kHz for one input stream (keeps resampler state)."""

    def __init__(self, fmt: FormatType) -> None:
        self.format = fmt
        self._resampler = StreamResampler(wire_rate(fmt), SAMPLE_RATE)

    def decode(self, data: bytes) -> np.ndarray:
        check_wire_bytes(data, self.format)
        return self._resampler.process(wire_to_samples(data, self.format))

    def flush(self) -> np.ndarray:
        return self._resampler.flush()


class AudioEncoder:
    """Streaming int16 24 kHz -> wire bytes for one output stream (keeps resampler state)."""

    def __init__(self, fmt: FormatType) -> None:
        self.format = fmt
        self._resampler = StreamResampler(SAMPLE_RATE, wire_rate(fmt))

    def encode(self, pcm24k: np.ndarray, last: bool = False) -> bytes:
        pcm24k = np.asarray(pcm24k, dtype=np.int16)
        if self.format == "audio/pcm":
            return int16_to_pcm16(pcm24k)
        x = self._resampler.process(int16_to_float(pcm24k), last=last)
        samples = float_to_int16(x)
        return mulaw_encode(samples) if self.format == "audio/pcmu" else alaw_encode(samples)
