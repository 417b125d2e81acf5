"""The VAD process: scores every session's audio with batched Silero calls, off the server's GIL.

Run by :class:`~omnirt.vad.worker.VadWorker` as ``python -m omnirt.vad.process --fd-in N
--fd-out M ...``; it speaks the byte protocol of :mod:`.wire` and imports numpy, soxr and
onnxruntime only (no torch).

Per stream it keeps the 24 kHz -> 16 kHz resampler, the last 64 samples of context, the model
state and the windows cut but not yet scored. Scoring goes in passes, at most one per
``gather_ms`` (a chunk arriving within that interval of the last pass waits for the rest of it,
so that several sessions' chunks share a model call; under load passes run back to back): a
pass takes every pending window of every
stream, in one batched model call per step (a stream's windows are sequential through its
state), and sends each step's results back as soon as it is done.

Why a process: inside the server, the model's calls and the Python between them waited for the
event loop to hand over the GIL (up to 5 ms each time, several times per batch), and the VAD
thread fell behind at 200 sessions. The process also runs at a raised priority when allowed
(``--nice``): its passes are short and late ones delay every session's turn detection.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import selectors
import socket
import sys
import time

import numpy as np
from omnirt.codecs.audio import SAMPLE_RATE, StreamResampler

from . import wire
from .model import CONTEXT, STATE_SHAPE, VAD_RATE, WINDOW, SileroModel, VadInitError

log = logging.getLogger("omnirt.vad.process")


class _Stream:
    def __init__(self, sid: int, first_index: int = 0) -> None:
        self.sid = sid
        self.resampler = StreamResampler(SAMPLE_RATE, VAD_RATE)
        #: The last CONTEXT samples of the last window cut, then the samples not yet in a window.
        self.tail = np.zeros(CONTEXT, dtype=np.float32)
        #: Cut windows not yet scored: (index of the first, [n, CONTEXT + WINDOW] rows, arrival).
        self.pending: list[tuple[int, np.ndarray, float]] = []
        self.cut = first_index
        self.state = np.zeros(STATE_SHAPE, dtype=np.float32)

    def push(self, pcm24k: np.ndarray, arrived: float) -> None:
        """Resample a chunk and queue the windows it completes, as rows of one strided view."""
        x = self.resampler.process(pcm24k)
        full = np.concatenate([self.tail, x]) if len(x) else self.tail
        count = (len(full) - CONTEXT) // WINDOW
        if count <= 0:
            self.tail = full
            return
        # Row i is full[i * WINDOW : i * WINDOW + CONTEXT + WINDOW]: the context, then new samples.
        rows = np.ndarray((count, CONTEXT + WINDOW), np.float32, full, 0, (WINDOW * 4, 4))
        self.tail = full[count * WINDOW :].copy()
        self.pending.append((self.cut, rows, arrived))
        self.cut += count

    def take(self) -> tuple[int, list[np.ndarray], list[float]]:
        """Every pending window: (index of the first, blocks of rows, each window's arrival)."""
        first = self.pending[0][0]
        blocks = [rows for _, rows, _ in self.pending]
        arrivals = [arrived for _, rows, arrived in self.pending for _ in range(len(rows))]
        self.pending = []
        return first, blocks, arrivals


class Scorer:
    """The process's state and its loop; ``inp`` / ``out`` are the two sockets to the server."""

    def __init__(self, model: SileroModel, inp: socket.socket, out: socket.socket, *,
                 max_batch: int, gather_ms: float) -> None:
        self.model = model
        self.inp = inp
        self.out = out
        self.max_batch = max_batch
        self.gather_s = gather_ms / 1000
        self.streams: dict[int, _Stream] = {}
        self.reader = wire.FrameReader(wire.TO_VAD)
        self.results: list[tuple[int, int, float, float]] = []
        self.batches = 0
        self.busy = 0.0
        self.syncs: list[int] = []
        #: Streams with windows waiting, in the order they got them.
        self.ready: dict[int, _Stream] = {}
        self._last_pass = 0.0
        inp.setblocking(False)

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.inp, selectors.EVENT_READ)
        while True:
            if not self.ready:
                self._post(answer_syncs=True)  # everything read so far is scored
                selector.select()
            if not self._read():
                return
            if not self.ready:
                continue
            # At most one pass per gather interval: under light load, wait for other sessions'
            # chunks to share the model calls; under load, passes run back to back.
            wait = self._last_pass + self.gather_s - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
                if not self._read():
                    return
            self._last_pass = time.perf_counter()
            self._pass()

    def _read(self) -> bool:
        """Applies every frame that has arrived; False when the server has gone."""
        while True:
            try:
                data = self.inp.recv(1 << 20)
            except BlockingIOError:
                return True
            if not data:
                return False
            for (op, sid, _, arrived), payload in self.reader.feed(data):
                if op == wire.AUDIO:
                    stream = self.streams.get(sid)
                    if stream is not None:
                        stream.push(np.frombuffer(payload, dtype=np.float32), arrived)
                        if stream.pending:
                            self.ready[sid] = stream
                elif op == wire.OPEN:
                    first = int.from_bytes(payload, "little") if payload else 0
                    self.streams[sid] = _Stream(sid, first)
                    self.ready.pop(sid, None)  # reopened: windows of the old state are dropped
                elif op == wire.CLOSE:
                    self.streams.pop(sid, None)
                    self.ready.pop(sid, None)
                elif op == wire.SYNC:
                    self.syncs.append(sid)

    def _pass(self) -> None:
        """Every pending window of every stream, in calls of about ``max_batch`` windows."""
        streams = list(self.ready.values())
        self.ready.clear()
        group: list[_Stream] = []
        windows = 0
        for stream in streams:
            group.append(stream)
            windows += sum(len(rows) for _, rows, _ in stream.pending)
            if windows >= self.max_batch:
                self._score(group)
                group, windows = [], 0
        if group:
            self._score(group)

    def _score(self, streams: list[_Stream]) -> None:
        """All pending windows of ``streams``: one batched model call per step (a stream's windows
        are sequential through its state); each step's results go back as soon as it is done."""
        taken = [s.take() for s in streams]
        blocks = [rows for _, stream_blocks, _ in taken for rows in stream_blocks]
        windows = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
        counts = np.array([len(arrivals) for _, _, arrivals in taken])
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        state = np.stack([s.state for s in streams], axis=1)  # [2, S, 128], fresh for this call
        for step in range(int(counts.max())):
            t0 = time.perf_counter()
            active = np.flatnonzero(counts > step) if step else np.arange(len(streams))
            try:
                probs, next_state = self.model.run(windows[starts[active] + step], state[:, active])
            except Exception as exc:  # a model failure must not stop every session's VAD
                log.error("a batch of %d windows failed (%s); scored as silence", len(active), exc)
                probs, next_state = np.zeros(len(active), np.float32), state[:, active]
            state[:, active] = next_state
            results = self.results
            for i, prob in zip(active.tolist(), probs.tolist(), strict=True):
                first, _, arrivals = taken[i]
                results.append((streams[i].sid, first + step, prob, arrivals[step]))
            self.batches += 1
            self.busy += time.perf_counter() - t0
            self._post()
        for i, stream in enumerate(streams):
            stream.state = state[:, i]  # views of this call's array, which nothing else writes

    def _post(self, *, answer_syncs: bool = False) -> None:
        """Sends the results so far, then (when told: nothing is pending) answers the syncs."""
        if self.results:
            records = np.array(self.results, dtype=wire.RESULT).tobytes()
            frame = wire.from_vad(wire.RESULTS, len(self.results), records, self.batches, self.busy)
            self.results, self.batches, self.busy = [], 0, 0.0
            self.out.sendall(frame)
        if answer_syncs and self.syncs:
            for token in self.syncs:
                self.out.sendall(wire.from_vad(wire.SYNCED, token))
            self.syncs = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="omnirt's server-VAD process (started by the server)")
    parser.add_argument("--fd-in", type=int, required=True)
    parser.add_argument("--fd-out", type=int, required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--gather-ms", type=float, default=3.0)
    parser.add_argument("--nice", type=int, default=0, help="niceness change (negative: higher priority)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError as exc:  # raising the priority needs CAP_SYS_NICE (or root)
            log.warning("cannot change the VAD process's priority by %d (%s); running at the default",
                        args.nice, exc)
    inp = socket.socket(fileno=args.fd_in)
    out = socket.socket(fileno=args.fd_out)
    try:
        model = SileroModel(args.model)
    except VadInitError as exc:
        out.sendall(wire.from_vad(wire.FAILED, 0, str(exc).encode()))
        return 1
    # The modules and the model live as long as the process: keep full collections from
    # walking them (a pause there delays every session's decisions).
    gc.collect()
    gc.freeze()
    out.sendall(wire.from_vad(wire.READY))
    try:
        Scorer(model, inp, out, max_batch=args.max_batch, gather_ms=args.gather_ms).run()
    except (BrokenPipeError, ConnectionResetError):  # the server has gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
