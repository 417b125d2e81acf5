"""The VAD alone: model loading, the worker's batching, and endpointing on real speech."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from omnirt.vad import wire
from omnirt.vad.endpointing import Endpointer, SpeechStart, SpeechStop
from omnirt.vad.model import (
    CONTEXT,
    WINDOW,
    WINDOW_MS,
    SileroModel,
    VadInitError,
    bundled_model_path,
)
from omnirt.vad.stream import VadStream
from omnirt.vad.worker import VadWorker

from .speech import RATE, SENTENCES, full_windows, hum, non_speech, place, spoken, white_noise


@pytest.fixture(scope="module")
def worker():
    w = VadWorker()
    yield w
    w.stop()


def score(
    worker: VadWorker, signals: list[np.ndarray], chunk_ms: int = 100, *, together: bool = False
) -> list[list[float]]:
    """Stream each signal through its own VadStream (chunks interleaved, as concurrent sessions).
    ``together``: the VAD process is paused while the chunks are sent, so that its passes find
    every session's windows waiting (how sessions share model calls does not then depend on how
    fast this thread sends)."""
    probs: list[list[float]] = [[] for _ in signals]
    streams: list[VadStream] = []
    for i in range(len(signals)):
        streams.append(worker.open_stream(lambda index, p, i=i: probs[i].append(p)))
    pid = worker._proc.pid  # type: ignore[union-attr]
    if together:
        os.kill(pid, signal.SIGSTOP)
    try:
        step = RATE * chunk_ms // 1000
        for start in range(0, max(len(s) for s in signals), step):
            for stream, s in zip(streams, signals, strict=True):
                if start < len(s):
                    stream.push(s[start : start + step])
    finally:
        if together:
            os.kill(pid, signal.SIGCONT)
    worker.sync(timeout=20)
    assert all(s.backlog_ms < 2 * WINDOW_MS for s in streams)
    for s in streams:
        s.close()
    return probs


def endpoints(probs: list[float], threshold: float = 0.5, silence_ms: int = 500) -> list[object]:
    ep = Endpointer(threshold, silence_ms)
    return [d for i, p in enumerate(probs) if (d := ep.step(i, p)) is not None]


def test_bundled_model_scores_a_batch() -> None:
    model = SileroModel()
    assert model.path == bundled_model_path() and model.path.name == "silero_vad.onnx"
    probs, state = model.run(np.zeros((3, CONTEXT + WINDOW), np.float32), np.zeros((2, 3, 128), np.float32))
    assert probs.shape == (3,) and state.shape == (2, 3, 128) and (probs < 0.1).all()


def test_missing_or_broken_model_file_is_a_clear_error(tmp_path) -> None:
    """A missing file, a file that is not ONNX, and an ONNX-looking truncation of the real model all
    raise VadInitError naming the file (never another exception)."""
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"this is not an onnx model")
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(bundled_model_path().read_bytes()[:5000])
    for path in (tmp_path / "missing.onnx", broken, truncated):
        with pytest.raises(VadInitError, match=path.name):
            SileroModel(path)
    worker = VadWorker(broken)
    with pytest.raises(VadInitError, match=broken.name) as first:  # the VAD process's reason
        worker.open_stream(lambda i, p: None)
    assert not worker.running
    with pytest.raises(VadInitError) as again:  # kept: no new process per request
        worker.open_stream(lambda i, p: None)
    assert again.value is first.value


def test_a_dead_vad_process_is_replaced_and_its_streams_go_on(caplog: pytest.LogCaptureFixture) -> None:
    """The VAD process killed mid-stream: the error is logged, a new process starts, the open
    stream goes on in it from the window after the audio it had pushed (window indices still
    match the audio's time), and new streams work too."""
    worker = VadWorker()
    try:
        got: list[tuple[int, float]] = []
        old = worker.open_stream(lambda i, p: got.append((i, p)))
        old.push(np.zeros(RATE // 2, np.float32))  # 500 ms: windows 0..14 (15 is incomplete)
        worker.sync()
        assert [i for i, _ in got] == list(range(15))
        pid = worker._proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while worker.stats.restarts == 0:  # counted once the stream is reopened in the new process
            assert time.monotonic() < deadline, "the VAD process was not restarted"
            time.sleep(0.01)
        assert worker.running and worker._proc.pid != pid  # type: ignore[union-attr]
        assert "VAD process exited" in caplog.text
        got.clear()
        old.push(np.zeros(RATE // 2, np.float32))  # the next 500 ms
        worker.sync()
        # 500 ms pushed before: it goes on at window 16 (ceil(500 / 32)), then 15 more windows.
        assert [i for i, _ in got] == list(range(16, 31))
        assert old.backlog_ms < 2 * WINDOW_MS
        fresh: list[float] = []
        worker.open_stream(lambda i, p: fresh.append(p)).push(np.zeros(RATE // 2, np.float32))
        worker.sync()
        assert len(fresh) == 15
        # Stopped, the worker starts over on the next stream (new process, new results loop).
        worker.stop()
        assert not worker.running
        again: list[float] = []
        worker.open_stream(lambda i, p: again.append(p)).push(np.zeros(RATE // 2, np.float32))
        worker.sync()
        assert len(again) >= 10
    finally:
        worker.stop()


def test_batched_streams_match_streams_scored_alone(worker: VadWorker) -> None:
    """Four sessions scored together (batched ONNX calls) give each the probabilities it gets
    alone: the model state is per session."""
    speech = place(spoken(SENTENCES[0]), lead_ms=300, tail_ms=300).audio
    signals = [speech, white_noise(3000), speech[::-1].copy(), hum(2000, 50)]
    alone = [score(worker, [s])[0] for s in signals]
    before = worker.stats.snapshot()
    together = score(worker, signals, together=True)
    assert worker.stats.since(before).mean_batch > 1.5  # windows of several sessions shared ONNX calls
    for a, t in zip(alone, together, strict=True):
        assert len(a) == len(t) and np.allclose(a, t, atol=1e-5)
    # A pass split into model calls of at most 2 windows' worth of sessions gives the same.
    small = VadWorker(max_batch=2)
    try:
        split = score(small, signals, together=True)
    finally:
        small.stop()
    for a, t in zip(alone, split, strict=True):
        assert len(a) == len(t) and np.allclose(a, t, atol=1e-5)


def test_frames_split_anywhere_across_reads_are_put_back_together() -> None:
    """The byte protocol between the server and the VAD process survives any split of the stream."""
    outgoing = wire.to_vad(wire.OPEN, 3) + wire.to_vad(wire.AUDIO, 3, b"\x01\x02\x03\x04", 12.5)
    incoming = wire.from_vad(wire.RESULTS, 2, b"r" * 40, batches=1, busy=0.25) + wire.from_vad(wire.SYNCED, 9)
    to_vad = [((wire.OPEN, 3, 0, 0.0), b""), ((wire.AUDIO, 3, 4, 12.5), b"\x01\x02\x03\x04")]
    from_vad = [((wire.RESULTS, 2, 1, 40, 0.25), b"r" * 40), ((wire.SYNCED, 9, 0, 0, 0.0), b"")]
    for data, header, expected in ((outgoing, wire.TO_VAD, to_vad), (incoming, wire.FROM_VAD, from_vad)):
        for size in (1, 3, 7, len(data)):
            reader = wire.FrameReader(header)
            frames = [f for at in range(0, len(data), size) for f in reader.feed(data[at : at + size])]
            assert frames == expected, size


@pytest.mark.parametrize("text", SENTENCES)
def test_endpoints_on_real_speech_within_200_ms(worker: VadWorker, text: str) -> None:
    placed = place(spoken(text), lead_ms=1000, tail_ms=1500, noise_db=-45)
    decisions = endpoints(score(worker, [placed.audio])[0])
    assert [type(d) for d in decisions] == [SpeechStart, SpeechStop], decisions
    start, stop = decisions
    assert isinstance(start, SpeechStart) and isinstance(stop, SpeechStop)
    assert abs(start.onset_ms - placed.start_ms) <= 200, (start, placed)
    assert abs(stop.end_ms - placed.end_ms) <= 200, (stop, placed)
    assert stop.decided_ms - stop.end_ms >= 500


@pytest.mark.parametrize("signal", non_speech(3000))
def test_no_speech_in_hum_noise_or_silence(worker: VadWorker, signal: np.ndarray) -> None:
    probs = score(worker, [signal])[0]
    assert full_windows(len(signal)) - 2 <= len(probs) <= full_windows(len(signal))  # resampler lag
    assert endpoints(probs) == []
    assert max(probs) < 0.35


def test_hysteresis_keeps_the_silence_run_where_it_began() -> None:
    """Speech ends below threshold - 0.15 (0.35). Windows between 0.35 and 0.5 inside a silence
    run neither reset nor move it; only a window >= 0.5 resets it."""
    ep = Endpointer(0.5, silence_duration_ms=160)  # 5 windows
    assert ep.step(0, 0.4) is None and not ep.speaking  # under threshold: no start
    assert ep.step(1, 0.9) == SpeechStart(1 * WINDOW_MS)
    assert ep.step(2, 0.45) is None  # between: not silence, speech goes on
    assert ep.step(3, 0.2) is None  # the run opens at window 3
    assert ep.step(4, 0.45) is None and ep.step(5, 0.2) is None and ep.step(6, 0.45) is None
    assert ep.step(7, 0.3) == SpeechStop(3 * WINDOW_MS, 8 * WINDOW_MS)  # 5 windows after 3
    assert not ep.speaking
    ep.step(10, 0.9)
    ep.step(11, 0.1)
    ep.step(12, 0.1)
    assert ep.step(13, 0.6) is None  # speech resumed: the run is reset
    for i in range(14, 18):
        assert ep.step(i, 0.1) is None
    assert ep.step(18, 0.1) == SpeechStop(14 * WINDOW_MS, 19 * WINDOW_MS)
