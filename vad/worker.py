"""The server's side of server VAD: a handle on the VAD process, and the streams it serves.

:class:`VadWorker` starts ``python -m omnirt.vad.process`` (see :mod:`.process`) on first use,
talks to it over two socket pairs in the byte protocol of :mod:`.wire`, and hands each stream's
results to its ``on_result`` on the event loop the stream was opened on. Scoring in a process
of its own keeps the model's calls, and the Python between them, off the server's GIL; the
server's event loop only writes each chunk to a socket and reads results back (registered with
the loop: no thread, no GIL hand-over).

Writes never block the loop: what the socket does not take at once waits in a queue flushed when
it is writable. A session's audio waiting for the VAD is bounded by the session's backlog limit
(``input_backpressure``). When the process dies, the error is logged and a new process is
started in a thread; the open streams are reopened in it with fresh model state, going on from
the window after the audio they had pushed (the audio in flight meanwhile is not scored).

Called outside any event loop (tests, scripts), the worker runs a private loop in a thread of its
own and delivers results there.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import collections
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import wire
from .model import VadInitError
from .stream import ResultCallback, VadStream

log = logging.getLogger(__name__)

#: Socket buffers asked for on each side (the kernel may give less).
SOCKET_BUFFER = 4 * 1024 * 1024


#: Upper bounds (seconds) of the decision-latency histogram's buckets (``/metrics``).
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


@dataclass
class VadStats:
    """Counters for ``/metrics`` and the benchmark (latencies are written on the event loop)."""

    windows: int = 0
    batches: int = 0
    #: Wall time the VAD process spent scoring (model calls and the batching around them).
    busy_seconds: float = 0.0
    #: Times the VAD process died and was replaced (counted once its streams were reopened).
    restarts: int = 0
    #: Decision latency (seconds from the arrival of the chunk that completed a window to its
    #: endpointing decision): the latest ones (enough for a benchmark's percentiles)...
    latencies: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=200_000))
    #: ... and all of them as a histogram: counts per bucket of :data:`LATENCY_BUCKETS` (the last
    #: entry counts those above every bound), and their sum.
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    def record_latency(self, seconds: float) -> None:
        self.latencies.append(seconds)
        self.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def snapshot(self) -> VadStats:
        """The counters as they are now, for :meth:`since` (the counters only ever grow:
        ``/metrics`` exports them)."""
        return VadStats(
            self.windows, self.batches, self.busy_seconds, self.restarts,
            collections.deque(maxlen=0), list(self.latency_buckets), self.latency_sum,
        )

    def since(self, earlier: VadStats) -> VadStats:
        """What was counted since the :meth:`snapshot` ``earlier``, with the latencies recorded
        since (as far as ``latencies`` still holds them)."""
        recorded = sum(self.latency_buckets) - sum(earlier.latency_buckets)
        return VadStats(
            self.windows - earlier.windows,
            self.batches - earlier.batches,
            self.busy_seconds - earlier.busy_seconds,
            self.restarts - earlier.restarts,
            collections.deque(list(self.latencies)[-recorded:] if recorded else []),
            [now - then for now, then in zip(self.latency_buckets, earlier.latency_buckets, strict=True)],
            self.latency_sum - earlier.latency_sum,
        )

    @property
    def mean_batch(self) -> float:
        return self.windows / self.batches if self.batches else 0.0


class _ModelFailed(VadInitError):
    """The VAD process started but its model did not load: retrying cannot help."""


class VadWorker:
    """Owns the VAD process (started on first use) and routes its results to streams."""

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None = None,
        *,
        max_batch: int = 256,
        gather_ms: float = 3.0,
        nice: int = 0,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.model_path = model_path
        self.max_batch = max_batch
        #: The process scores at most once per this interval: a chunk arriving within it of the
        #: last pass waits for the rest, so that chunks of several sessions share the model calls
        #: (less CPU per window, for at most this much latency).
        self.gather_ms = gather_ms
        #: Niceness change for the VAD process (negative: higher priority; needs CAP_SYS_NICE, else
        #: the process logs a warning and runs at the default priority).
        self.nice = nice
        self.start_timeout_s = start_timeout_s
        self.stats = VadStats()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._to: socket.socket | None = None  # server -> VAD process
        self._from: socket.socket | None = None  # VAD process -> server
        self._reader = wire.FrameReader(wire.FROM_VAD)
        self._outgoing: collections.deque[memoryview] = collections.deque()
        #: The loop that reads results (and does every socket write), and its thread.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._private: threading.Thread | None = None
        self._registered: socket.socket | None = None
        self._streams: dict[int, VadStream] = {}
        self._next_id = 1
        self._syncs: dict[int, threading.Event] = {}
        self._generation = 0  # bumped by stop(): a restart scheduled before it is dropped
        #: Set while a new process replaces one that died (streams opened meanwhile wait for it).
        self._restarting = False
        #: The model's load failure, raised again by :meth:`load` without another process.
        self._failure: VadInitError | None = None
        atexit.register(self.stop)

    # -- the process ---------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def load(self) -> None:
        """Starts the VAD process and waits until its model has loaded and run once.

        Raises :class:`VadInitError` when it cannot: a model that does not load (missing or broken
        file) is reported again by every later call without starting another process (until
        :meth:`stop`); a process that fails to start is tried again by the next call."""
        with self._lock:
            if self._proc is not None:
                return
            if self._failure is not None:
                raise self._failure
            try:
                self._proc, self._to, self._from = self._start_process()
            except _ModelFailed as exc:
                self._failure = exc
                raise
            self._reader = wire.FrameReader(wire.FROM_VAD)
            log.info("server VAD: process %d ready (model %s)", self._proc.pid, self.model_path or "bundled")

    def _start_process(self) -> tuple[subprocess.Popen[bytes], socket.socket, socket.socket]:
        to_vad, vad_in = socket.socketpair()
        from_vad, vad_out = socket.socketpair()
        for sock, option in ((to_vad, socket.SO_SNDBUF), (vad_in, socket.SO_RCVBUF)):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        command = [
            sys.executable, "-m", "omnirt.vad.process",
            "--fd-in", str(vad_in.fileno()), "--fd-out", str(vad_out.fileno()),
            "--max-batch", str(self.max_batch), "--gather-ms", str(self.gather_ms), "--nice", str(self.nice),
        ]
        if self.model_path is not None:
            command += ["--model", str(self.model_path)]
        try:
            proc = subprocess.Popen(
                command,
                pass_fds=(vad_in.fileno(), vad_out.fileno()),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        except OSError as exc:
            for sock in (to_vad, vad_in, from_vad, vad_out):
                sock.close()
            raise VadInitError(f"cannot start the VAD process: {exc}") from None
        finally:
            vad_in.close()
            vad_out.close()
        try:
            self._handshake(proc, from_vad)
        except BaseException:
            to_vad.close()
            from_vad.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            raise
        to_vad.setblocking(False)
        from_vad.setblocking(False)
        return proc, to_vad, from_vad

    def _handshake(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        reader = wire.FrameReader(wire.FROM_VAD)
        deadline = time.monotonic() + self.start_timeout_s
        frames: list[tuple[tuple, bytes]] = []
        while not frames:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                raise VadInitError(
                    f"the VAD process did not start within {self.start_timeout_s:g} s"
                ) from None
            if not data:
                code = proc.wait(10)
                raise VadInitError(f"the VAD process exited (code {code}) before loading its model")
            frames = reader.feed(data)
        (op, *_), payload = frames[0]
        if op == wire.FAILED:
            raise _ModelFailed(payload.decode(errors="replace"))
        if op != wire.READY:
            raise VadInitError(f"the VAD process answered {op} instead of READY")

    # -- streams -------------------------------------------------------------------------------
    def open_stream(self, on_result: ResultCallback) -> VadStream:
        """A new stream (fresh model state) whose results arrive on the running event loop;
        raises :class:`VadInitError` when the VAD process cannot start. While a process that died is
        being replaced, the stream is opened in the new one when it is ready."""
        if not self._restarting:
            self.load()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        home = self._bind(loop)
        with self._lock:
            sid = self._next_id
            self._next_id += 1
        stream = VadStream(self, sid, on_result, loop or home)
        self._streams[sid] = stream
        self._send(wire.to_vad(wire.OPEN, sid))
        return stream

    def send_audio(self, stream: VadStream, pcm: bytes, arrived: float) -> None:
        self._send(wire.to_vad(wire.AUDIO, stream.sid, pcm, arrived))

    def close_stream(self, stream: VadStream) -> None:
        if self._streams.pop(stream.sid, None) is not None:
            self._send(wire.to_vad(wire.CLOSE, stream.sid))

    def sync(self, timeout: float = 30.0) -> None:
        """Blocks until every chunk sent so far is scored and its results delivered on the loop
        that reads them (call it from another thread, e.g. a test's)."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("VadWorker.sync() would block the loop that delivers the results")
        with self._lock:
            token = self._next_id
            self._next_id += 1
        done = self._syncs[token] = threading.Event()
        self._send(wire.to_vad(wire.SYNC, token))
        if not done.wait(timeout):
            self._syncs.pop(token, None)
            raise TimeoutError(f"the VAD did not catch up within {timeout:g} s")

    # -- the loop's side -----------------------------------------------------------------------
    def _bind(self, loop: asyncio.AbstractEventLoop | None) -> asyncio.AbstractEventLoop:
        """The loop that reads results (the first one a stream was opened on, or a private one),
        with the current process's socket registered on it."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                if loop is None:
                    self._loop, self._loop_thread = self._start_private_loop()
                else:
                    self._loop, self._loop_thread = loop, threading.get_ident()
            home = self._loop
        self._on_home(self._register)
        return home

    def _start_private_loop(self) -> tuple[asyncio.AbstractEventLoop, int]:
        loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            loop.run_forever()
            loop.close()

        self._private = threading.Thread(target=run, name="omnirt-vad-results", daemon=True)
        self._private.start()
        started.wait()
        assert self._private.ident is not None
        return loop, self._private.ident

    def _on_home(self, function, *args) -> None:  # type: ignore[no-untyped-def]
        """Runs ``function(*args)`` on the results loop: now when called there, else soon."""
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            function(*args)
        else:
            try:
                loop.call_soon_threadsafe(function, *args)
            except RuntimeError:  # that loop is closed
                pass

    def _register(self) -> None:
        """On the results loop: read the current process's results. Streams opened before it (in
        a process that died) are reopened in it, going on at their audio time."""
        sock = self._from
        if sock is None or self._registered is sock or self._loop is None:
            return
        self._loop.add_reader(sock, self._on_readable)
        self._registered = sock
        for stream in self._streams.values():
            self._write(wire.to_vad(wire.OPEN, stream.sid, stream.resume_at().to_bytes(4, "little")))

    def _send(self, frame: bytes) -> None:
        self._on_home(self._write, frame)

    def _write(self, frame: bytes) -> None:
        sock = self._to
        if sock is None:
            return
        if self._outgoing:
            self._outgoing.append(memoryview(frame))
            return
        try:
            sent = sock.send(frame)
        except BlockingIOError:
            sent = 0
        except OSError:  # the process has gone; the reader finds out and reports it
            return
        if sent < len(frame):
            self._outgoing.append(memoryview(frame)[sent:])
            assert self._loop is not None
            self._loop.add_writer(sock, self._flush)

    def _flush(self) -> None:
        sock = self._to
        while sock is not None and self._outgoing:
            head = self._outgoing[0]
            try:
                sent = sock.send(head)
            except BlockingIOError:
                return
            except OSError:
                self._outgoing.clear()
                break
            if sent < len(head):
                self._outgoing[0] = head[sent:]
                return
            self._outgoing.popleft()
        if sock is not None and self._loop is not None:
            self._loop.remove_writer(sock)

    def _on_readable(self) -> None:
        sock = self._from
        if sock is None:
            return
        while True:
            try:
                data = sock.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._process_gone()
                return
            for (op, arg, batches, _, busy), payload in self._reader.feed(data):
                if op == wire.RESULTS:
                    self._results(arg, batches, busy, payload)
                elif op == wire.SYNCED:
                    done = self._syncs.pop(arg, None)
                    if done is not None:
                        done.set()

    def _results(self, count: int, batches: int, busy: float, payload: bytes) -> None:
        stats = self.stats
        stats.windows += count
        stats.batches += batches
        stats.busy_seconds += busy
        records = np.frombuffer(payload, dtype=wire.RESULT)
        streams, home = self._streams, self._loop
        for sid, index, prob, arrived in zip(
            records["stream"].tolist(), records["index"].tolist(), records["prob"].tolist(),
            records["arrived"].tolist(), strict=True,
        ):
            stream = streams.get(sid)
            if stream is None:  # closed while its windows were being scored
                continue
            if stream.loop is home:
                self._deliver(stream, index, prob, arrived)
            else:
                stream.loop.call_soon_threadsafe(self._deliver, stream, index, prob, arrived)

    def _deliver(self, stream: VadStream, index: int, prob: float, arrived: float) -> None:
        try:
            stream.deliver(index, prob)
        except Exception:  # one session's failure must not lose the others' results
            log.exception("VAD result handler failed")
        self.stats.record_latency(time.perf_counter() - arrived)

    def _process_gone(self) -> None:
        """On the results loop: the VAD process has exited. A new one is started in a thread and
        the open streams are reopened in it, each going on from the window after the audio it
        has pushed (what the old process had not scored is skipped)."""
        proc = self._proc
        code = proc.poll() if proc is not None else None
        log.error(
            "the server VAD process exited (code %s); restarting it for %d open stream(s)",
            code, len(self._streams),
        )
        self._close_sockets()
        with self._lock:
            self._proc = None
        self._release_syncs()
        self._restarting = True
        assert self._loop is not None
        self._loop.run_in_executor(None, self._restart, self._generation)

    def _restart(self, generation: int) -> None:
        """In a worker thread: start a new process, then reopen the streams on the results loop
        (unless the worker was stopped meanwhile)."""
        try:
            with self._lock:
                if generation != self._generation:
                    return
            self.load()
        except VadInitError as exc:
            log.error("the server VAD process could not be restarted (%s); its sessions get VAD "
                      "decisions again once a process starts (the next server_vad session tries)", exc)
            self._on_home(self._end_restart)
            return
        self._on_home(self._reopen)

    def _end_restart(self) -> None:
        self._restarting = False

    def _reopen(self) -> None:
        self._restarting = False
        if self._proc is None:  # stopped meanwhile
            return
        self._register()
        self.stats.restarts += 1
        log.info("server VAD: %d stream(s) reopened in the new process", len(self._streams))

    def _close_sockets(self) -> None:
        """On the results loop: unregister and close both sockets."""
        loop = self._loop
        for sock in (self._from, self._to):
            if sock is None:
                continue
            if loop is not None and not loop.is_closed():
                loop.remove_reader(sock)
                loop.remove_writer(sock)
            sock.close()
        self._from = self._to = self._registered = None
        self._outgoing.clear()

    def _release_syncs(self) -> None:
        for done in self._syncs.values():
            done.set()
        self._syncs.clear()

    # -- shutdown ------------------------------------------------------------------------------
    def stop(self, timeout: float = 5.0) -> None:
        """Ends the VAD process (its sockets closed, then terminated if it lingers) and the
        private loop, if any. Open streams get no more results."""
        with self._lock:
            proc, self._proc = self._proc, None
            private, self._private = self._private, None
            self._generation += 1
            self._restarting = False
            self._failure = None
        if threading.get_ident() == self._loop_thread or self._loop is None or self._loop.is_closed():
            self._close_sockets()
        else:
            closed = threading.Event()

            def close_there() -> None:
                self._close_sockets()
                closed.set()

            try:
                self._loop.call_soon_threadsafe(close_there)
                if not closed.wait(timeout):
                    raise RuntimeError
            except RuntimeError:  # the loop has stopped: nothing is registered any more
                self._close_sockets()
        self._streams.clear()
        self._release_syncs()
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if private is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            private.join(timeout)
        # Nothing is registered on the loop any more: the next stream binds afresh.
        self._loop, self._loop_thread = None, 0


__all__ = ["VadInitError", "VadStats", "VadWorker"]
