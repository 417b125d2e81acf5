"""The session's side of turn taking, without a WebSocket: the input buffer's session-time
addressing (what server VAD commits and trims) and the effective turn_detection settings."""

from __future__ import annotations

import numpy as np
from omnirt.sessions.input_buffer import InputAudioBuffer
from omnirt.sessions.turns import effective_turn_detection, vad_settings


def pcm(samples: np.ndarray) -> bytes:
    return (samples * 32768).astype("<i2").tobytes()


def test_buffer_addresses_samples_in_session_time() -> None:
    """start/end count every sample of the session; take() returns exactly the asked range and
    drops what is before its end; drop_before() trims; commit/clear move start to end."""
    buf = InputAudioBuffer("audio/pcm", max_bytes=10**9)
    ramp = (np.arange(24_000) % 1000 / 1000 * 0.5).astype(np.float32)
    buf.append(pcm(ramp))
    assert (buf.start, buf.end, buf.end_ms) == (0, 24_000, 1000)
    buf.drop_before(4_800)  # 200 ms of silence trimmed
    assert buf.start == 4_800 and buf.start_ms == 200 and round(buf.duration_ms) == 800
    part = buf.take(2_400, 12_000)  # clipped at what is held
    assert len(part) == 12_000 - 4_800
    assert np.allclose(part, ramp[4_800:12_000], atol=1 / 32768)
    assert buf.start == 12_000 and round(buf.duration_ms) == 500
    buf.drop_before(1_000)  # before start: nothing happens
    assert buf.start == 12_000
    buf.append(pcm(ramp[:2_400]))
    assert buf.end == 26_400
    buf.clear()
    assert buf.start == buf.end == 26_400 and buf.duration_ms == 0


def test_effective_turn_detection_fills_defaults_and_maps_semantic_vad() -> None:
    assert effective_turn_detection(None) is None
    full = effective_turn_detection({"type": "server_vad", "threshold": 0.7, "idle_timeout_ms": 5000})
    assert full == {
        "type": "server_vad",
        "threshold": 0.7,
        "prefix_padding_ms": 300,
        "silence_duration_ms": 500,
        "create_response": True,
        "interrupt_response": True,
        "idle_timeout_ms": 5000,
    }
    assert vad_settings(full).idle_timeout_ms == 5000
    semantic = effective_turn_detection(
        {"type": "semantic_vad", "eagerness": "low", "create_response": False}
    )
    assert semantic == {
        "type": "semantic_vad",
        "eagerness": "low",
        "create_response": False,
        "interrupt_response": True,
    }
    settings = vad_settings(semantic)
    assert (settings.silence_duration_ms, settings.threshold, settings.create_response) == (1200, 0.5, False)
    assert vad_settings(effective_turn_detection({"type": "semantic_vad"})).silence_duration_ms == 700
