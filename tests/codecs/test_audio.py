"""PCM, base64, G.711 and resampling helpers."""

from __future__ import annotations

import numpy as np
import pytest
from omnirt.codecs.audio import (
    AudioDecoder,
    AudioEncoder,
    StreamResampler,
    alaw_decode,
    alaw_encode,
    b64decode,
    b64encode,
    decode_audio,
    float_to_pcm16,
    mulaw_decode,
    mulaw_encode,
    pcm16_to_float,
    resample,
)

ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)


def test_pcm16_round_trip_and_odd_bytes() -> None:
    x = np.array([0, 1, -1, 32767, -32768], np.int16)
    f = pcm16_to_float(x.astype("<i2").tobytes())
    assert f.dtype == np.float32 and f[3] == pytest.approx(32767 / 32768)
    assert float_to_pcm16(f) == x.astype("<i2").tobytes()
    with pytest.raises(ValueError):
        pcm16_to_float(b"\x00\x00\x00")


def test_base64_is_strict() -> None:
    assert b64decode(b64encode(b"\x00\xff")) == b"\x00\xff"
    for bad in ("abc", "a b=", "!!!!"):
        with pytest.raises(ValueError):
            b64decode(bad)


# Reference values from the ITU-T G.711 reference coder (== Python's audioop on 3.11).
@pytest.mark.parametrize(
    ("sample", "ulaw", "alaw"),
    [
        (0, 0xFF, 0xD5),
        (-1, 0x7E, 0x55),
        (1000, 0xCE, 0xFA),
        (-1000, 0x4E, 0x7A),
        (32767, 0x80, 0xAA),
        (-32768, 0x00, 0x2A),
    ],
)
def test_g711_reference_values(sample: int, ulaw: int, alaw: int) -> None:
    assert mulaw_encode(np.array([sample], np.int16)) == bytes([ulaw])
    assert alaw_encode(np.array([sample], np.int16)) == bytes([alaw])


def test_g711_matches_audioop_on_every_sample() -> None:
    audioop = pytest.importorskip("audioop")
    pcm = ALL_INT16.astype("<i2").tobytes()
    assert mulaw_encode(ALL_INT16) == audioop.lin2ulaw(pcm, 2)
    assert alaw_encode(ALL_INT16) == audioop.lin2alaw(pcm, 2)
    codes = bytes(range(256))
    assert mulaw_decode(codes).astype("<i2").tobytes() == audioop.ulaw2lin(codes, 2)
    assert alaw_decode(codes).astype("<i2").tobytes() == audioop.alaw2lin(codes, 2)


def test_g711_decode_then_encode_is_identity() -> None:
    codes = bytes(range(256))
    negative_zero = bytes(c for c in range(256) if c != 0x7F)  # mu-law -0 decodes to 0 -> 0xFF
    assert mulaw_encode(mulaw_decode(negative_zero)) == negative_zero
    assert mulaw_encode(mulaw_decode(b"\x7f")) == b"\xff"
    assert alaw_encode(alaw_decode(codes)) == codes


def test_streaming_resampler_matches_length_and_signal() -> None:
    t = np.arange(8000) / 8000
    x = np.sin(2 * np.pi * 200 * t).astype(np.float32)
    stream = StreamResampler(8000, 24000)
    y = np.concatenate([stream.process(x[i : i + 160]) for i in range(0, 8000, 160)] + [stream.flush()])
    whole = resample(x, 8000, 24000)
    assert len(y) == len(whole) == 24000
    assert np.max(np.abs(y[100:-100] - whole[100:-100])) < 1e-3


def test_encoder_decoder_round_trip_through_g711() -> None:
    t = np.arange(24000) / 24000
    pcm = (0.3 * np.sin(2 * np.pi * 300 * t) * 32767).astype(np.int16)
    for fmt in ("audio/pcmu", "audio/pcma"):
        enc = AudioEncoder(fmt)
        wire = b"".join(enc.encode(pcm[i : i + 1920]) for i in range(0, 24000, 1920)) + enc.encode(
            np.zeros(0, np.int16), last=True
        )
        assert len(wire) == 8000
        back = decode_audio(wire, fmt)
        assert np.corrcoef(back[500:-500], pcm[500:-500])[0, 1] > 0.99
        dec = AudioDecoder(fmt)
        streamed = np.concatenate([dec.decode(wire[i : i + 80]) for i in range(0, 8000, 80)] + [dec.flush()])
        assert len(streamed) == 24000
    assert AudioEncoder("audio/pcm").encode(pcm) == pcm.astype("<i2").tobytes()
