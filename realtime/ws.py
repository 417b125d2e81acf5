"""The ``/v1/realtime`` WebSocket endpoint (turn-based and native full-duplex sessions; PROTOCOL.md).

Per connection one task reads client frames and applies them to the session while a writer task
sends what the session emits, in order, so responses stream while the client keeps talking.
Session events are serialized the moment they are emitted (they may reference live state).

Sessions share the app's :class:`~omnirt.vad.worker.VadWorker` (a handle on the VAD process,
started with the app unless ``vad_preload`` is off, then by the first session: sessions start with
server VAD, OpenAI's default). ``?turn=push_to_talk`` opens a push-to-talk session (extension). A
client asking for the beta protocol (``OpenAI-Beta: realtime=v1``; :mod:`.protocol.beta`) gets it
by translation here, at the edge: its events are made GA before they are parsed, the session's GA
events beta before they are sent.

``?duplex=1`` opens a :class:`~omnirt.sessions.duplex.DuplexSession` when the engine has a duplex
pipeline (else it is refused: ``unsupported``, close 1008); the connection drives it exactly as a
turn session.

Backpressure: the frames waiting for the socket are counted in bytes. Past
``hold_send_queue_bytes`` the session's responses are held (the engine gives them no steps) until
the client has read the queue down to half of that, so a client that does not read costs no
compute; one held for ``max_held_seconds``, or one that falls ``max_send_queue_bytes`` behind
anyway (events that are not generated: errors, echoes), has its responses cancelled and its queue
dropped, and is closed with 1008 (policy violation: the client's doing, not the server's load).
On shutdown (:meth:`RealtimeService.shutdown`) each connection's streaming responses end with
``response.done`` (``cancelled``) before it closes with 1012 (service restart). A replica being
removed (``omnirt serve --replicas``) drains instead (:meth:`RealtimeService.drain`): no new
sessions (1012: reconnect, to another replica), live ones go on for a grace period, then end the
same way but close with 1001 (going away).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from omnirt.sessions.config import SessionLimits
from omnirt.sessions.duplex import DuplexSession, DuplexSettings
from omnirt.sessions.errors import ErrorCode, SessionError
from omnirt.sessions.events import SessionEvent
from omnirt.sessions.manager import SessionManager
from omnirt.sessions.session import RealtimeSession
from omnirt.sessions.streaming import Submitter
from omnirt.sessions.stretches import StretchRule
from omnirt.sessions.voices import VoiceCatalog
from omnirt.vad.worker import VadStats, VadWorker
from starlette.websockets import WebSocket, WebSocketDisconnect

from .auth import accepted_subprotocol, authorized, subprotocols
from .config import ServerConfig
from .ids import new_id
from .protocol.beta import beta_requested, client_event_to_ga, server_event_to_beta
from .protocol.client_events import parse_client_event
from .protocol.dispatch import CloseRequested, Limits, apply, decode_payload
from .protocol.errors import ProtocolError
from .protocol.models import ClientEvent
from .protocol.server_events import MAX_SERVER_FRAME, Serializer, dumps, error_event
from .ws_protocol import SOCKET_EXTENSION, unsent_bytes

log = logging.getLogger(__name__)
#: Seconds between looks at a held client's socket (its kernel queue drains unseen by the writer).
_POLL = 0.25

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # session lifetime over
CLOSE_POLICY = 1008  # asked for something this server does not serve (duplex); fell too far behind
CLOSE_SERVICE_RESTART = 1012  # the server is shutting down
CLOSE_TRY_LATER = 1013  # max sessions reached
CLOSE_UNAUTHORIZED = 3000

#: Client frames larger than this are parsed and decoded in a worker thread.
OFFLOAD_FRAME_CHARS = 256 * 1024
#: How long a close frame may wait for a client that is not reading before the socket is dropped.
CLOSE_WAIT_SECONDS = 2.0
#: Values of the ``turn`` query parameter (extension): ``push_to_talk`` marks the session.
TURN_MODES = ("manual", "push_to_talk")


class RealtimeService:
    """Serves ``/v1/realtime``; mount ``service.handle`` as a WebSocket route."""

    def __init__(self, client: Submitter, config: ServerConfig, vad: VadWorker | None = None) -> None:
        self.client = client
        self.config = config
        self.sessions = SessionManager(config.max_sessions)
        info = getattr(client, "info", None)
        self.model = info.id if info is not None else (config.models[0] if config.models else "omnirt")
        self.limits = SessionLimits(
            max_input_buffer_bytes=config.max_input_buffer_bytes,
            max_output_tokens=config.max_output_tokens,
            voices=VoiceCatalog.for_model(
                tuple(info.voices) if info is not None else (), config.voice_aliases
            ),
            max_vad_backlog_ms=config.max_vad_backlog_ms,
            max_images=config.max_images_per_session,
            max_image_bytes=config.max_image_bytes,
            max_out_of_band_responses=config.max_out_of_band_responses,
            max_items=config.max_conversation_items,
            max_conversation_bytes=config.max_conversation_bytes,
            max_context_tokens=info.max_context_tokens if info is not None else 4096,
        )
        #: Server VAD for every session (None: sessions asking for it get
        #: ``server_vad_initialization_failed``).
        self.vad = vad
        self.events_received = 0
        self.events_sent = 0
        self.errors_sent = 0
        #: Times a connection's responses were held for its client being behind.
        self.clients_held = 0
        #: Connections closed for falling ``max_send_queue_bytes`` behind (or held too long).
        self.slow_clients_closed = 0
        self.connections: set[Connection] = set()
        self.shutting_down = False
        #: Set by :meth:`drain`: new sessions are refused, live ones end after the grace period.
        self.draining = False
        serves = getattr(client, "serves", None)
        #: Whether ``?duplex=1`` is served (the engine has a duplex pipeline).
        self.duplex = bool(serves is not None and serves("duplex"))
        self.duplex_settings = DuplexSettings(
            max_ahead_ms=config.duplex_max_ahead_ms,
            stretch=StretchRule(quiet_dbfs=config.duplex_quiet_dbfs, quiet_frames=config.duplex_quiet_frames),
        )
        duplex_pipeline = getattr(getattr(client, "engine", None), "pipelines", {}).get("duplex")
        #: The model duplex sessions name.
        self.duplex_model = duplex_pipeline.info.id if duplex_pipeline is not None else self.model

    async def shutdown(self, timeout: float | None = None) -> None:
        """End every connection: its streaming responses get ``response.done`` (``cancelled``),
        then it closes with 1012. Waits for them up to ``timeout`` (default
        ``shutdown_grace_seconds``); new connections are refused meanwhile (1012)."""
        self.shutting_down = True
        connections = list(self.connections)
        if not connections:
            return
        log.info("shutting down: closing %d realtime session(s)", len(connections))
        tasks = [c.stop_for_shutdown() for c in connections]
        done = [t for t in tasks if t is not None]
        if done:
            grace = self.config.shutdown_grace_seconds if timeout is None else timeout
            await asyncio.wait(done, timeout=grace)

    async def drain(self, grace: float) -> None:
        """Stop admitting sessions (a new one is closed with 1012, so its client reconnects, to
        another replica) and let the live ones go on for ``grace`` seconds; then end those left:
        streaming responses get ``response.done`` (``cancelled``), then close 1001 (going away).
        Returns once they have closed (each within ``shutdown_grace_seconds`` more)."""
        self.draining = True
        log.info("draining: %d realtime session(s) may go on for %gs", len(self.connections), grace)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
        connections = list(self.connections)
        if not connections:
            return
        log.info("drain grace over: closing %d realtime session(s) with 1001", len(connections))
        tasks = [t for t in (c.stop_for_drain() for c in connections) if t is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.shutdown_grace_seconds)

    @property
    def vad_stats(self) -> VadStats:
        return self.vad.stats if self.vad is not None else VadStats()

    @property
    def active_sessions(self) -> int:
        return self.sessions.active

    @property
    def sessions_total(self) -> int:
        return self.sessions.total

    async def handle(self, websocket: WebSocket) -> None:
        await websocket.accept(subprotocol=accepted_subprotocol(websocket.headers))
        if not authorized(websocket.headers, self.config.api_keys):
            await self._refuse(websocket, ErrorCode.INVALID_API_KEY, "Invalid API key.", CLOSE_UNAUTHORIZED)
            return
        duplex = websocket.query_params.get("duplex") == "1"
        if duplex and not self.duplex:
            await self._refuse(
                websocket,
                ErrorCode.UNSUPPORTED,
                "Native full duplex (duplex=1) is not available on this server; connect without it "
                "(or with duplex=0) for turn-based sessions.",
                CLOSE_POLICY,
            )
            return
        turn = websocket.query_params.get("turn") or "manual"
        if turn not in TURN_MODES:
            await self._refuse(
                websocket,
                ErrorCode.INVALID_VALUE,
                f"Unknown turn mode '{turn}' in the query; use one of {', '.join(TURN_MODES)} "
                "(server VAD is set with session.update).",
                CLOSE_POLICY,
            )
            return
        if duplex and turn != "manual":
            await self._refuse(
                websocket,
                ErrorCode.INVALID_VALUE,
                f"turn={turn} does not apply to a full-duplex session (duplex=1): the model listens and "
                "speaks at once, without turns; connect without turn.",
                CLOSE_POLICY,
            )
            return
        if self.shutting_down or self.draining:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                await websocket.close(CLOSE_SERVICE_RESTART)
            return
        lease = self.sessions.admit()
        if lease is None:
            await self._refuse(
                websocket,
                ErrorCode.RESOURCE_EXHAUSTED,
                f"This server is at its limit of {self.config.max_sessions} realtime sessions; "
                "try again later.",
                CLOSE_TRY_LATER,
                type="server_error",
            )
            return
        beta = beta_requested(websocket.headers, websocket.query_params, subprotocols(websocket.headers))
        with lease:
            connection = Connection(
                self, websocket, push_to_talk=turn == "push_to_talk", beta=beta, duplex=duplex
            )
            log.info(
                "realtime session %s opened%s%s (%d active)",
                connection.session.id,
                " (full duplex)" if duplex else "",
                " (beta protocol)" if beta else "",
                self.active_sessions,
            )
            self.connections.add(connection)
            try:
                await connection.run()
            finally:
                self.connections.discard(connection)
                log.info("realtime session %s ended", connection.session.id)

    async def _refuse(
        self,
        websocket: WebSocket,
        code: ErrorCode,
        message: str,
        close_code: int,
        type: str = "invalid_request_error",
    ) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
            await websocket.send_text(dumps(error_event(new_id("event"), code, message, type=type)))
            self.events_sent += 1
            self.errors_sent += 1
            await websocket.close(close_code)


def drop_traceback(task: asyncio.Task[Any]) -> None:
    """Forget the frames a finished task's exception passed through. Each ``await task`` adds the
    awaiting frame to the exception's traceback, and those frames hold the task (``run``'s and
    ``_drain``'s ``writer``), which holds the exception: a cycle that would keep the whole
    connection (session, conversation, audio buffers) until the garbage collector ran. The writer
    fails so when the client vanishes while a frame is being sent."""
    if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
        exc.__traceback__ = None


class Connection:
    """One client connection: its session, reader and writer."""

    def __init__(
        self,
        service: RealtimeService,
        websocket: WebSocket,
        *,
        push_to_talk: bool = False,
        beta: bool = False,
        duplex: bool = False,
    ) -> None:
        self.service = service
        self.ws = websocket
        #: The beta protocol's translations (None: GA, as the session speaks).
        self._to_ga = client_event_to_ga if beta else None
        self._to_beta = server_event_to_beta if beta else None
        #: Serialized frames to send, each with whether it is an error event (for the counters).
        self.outbox: asyncio.Queue[tuple[str, bool] | None] = asyncio.Queue()
        #: Bytes (characters) of the frames in ``outbox`` and the one being sent; over
        #: ``max_send_queue_bytes`` the client is closed (:meth:`_fell_behind`).
        self.queued_bytes = 0
        self._max_queued = service.config.max_send_queue_bytes
        #: Over this many queued bytes the session's responses are held (:meth:`_hold`); the timer
        #: that closes a client held too long runs while they are.
        self._hold_mark = min(service.config.hold_send_queue_bytes, self._max_queued)
        self._held_timer: asyncio.TimerHandle | None = None
        #: The connection's socket (``omnirt serve``'s protocol puts it in the scope) and the
        #: bytes of its kernel send queue the client may leave untaken before it is held too
        #: (0: not watched); while held, :meth:`_poll_release` looks again every ``_POLL`` s.
        extension = (websocket.scope.get("extensions") or {}).get(SOCKET_EXTENSION) or {}
        self._socket = extension.get("socket")
        self._socket_mark = service.config.hold_socket_bytes if self._socket is not None else 0
        self._poll: asyncio.TimerHandle | None = None
        #: The close reason of a client closed for being behind.
        self._behind = ""
        #: Why the reader was stopped from outside: "writer", "idle", "behind" or "shutdown".
        self._stopped: str | None = None
        self._reader: asyncio.Task[Any] | None = None
        #: When the reader last got a frame (loop time), and the idle timer watching it.
        self._last_read = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._run_task: asyncio.Task[Any] | None = None
        self.session: RealtimeSession | DuplexSession
        if duplex:
            self.session = DuplexSession(
                service.client,  # type: ignore[arg-type]  # an EngineClient: it can open live requests
                model=service.duplex_model,
                limits=service.limits,
                emit=self._emit,
                new_id=new_id,
                settings=service.duplex_settings,
                check_sendable=self._check_sendable,
            )
        else:
            self.session = RealtimeSession(
                service.client,
                model=service.model,
                limits=service.limits,
                emit=self._emit,
                new_id=new_id,
                vad=service.vad,
                push_to_talk=push_to_talk,
                check_sendable=self._check_sendable,
            )
        session = self.session  # not ``self``: the closure must not hold the connection (a cycle)
        self._serialize = Serializer(new_id, lambda: session.config)
        self._limits = Limits(max_append_bytes=service.config.max_append_bytes)

    # -- outgoing ----------------------------------------------------------------------------
    def _emit(self, event: SessionEvent) -> None:
        self._send(self._serialize(event))

    def _frame(self, event: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
        """The event as this client receives it (GA or beta) and its frame; None: not sent."""
        if self._to_beta is not None:
            translated = self._to_beta(event)
            if translated is None:  # no beta counterpart
                return None
            event = translated
        return event, dumps(event)

    def _check_sendable(self, event: SessionEvent, param: str) -> None:
        """Refuse (``invalid_value`` on ``param``) a change whose echo would be over the frame limit."""
        framed = self._frame(self._serialize(event))
        if framed is None:
            return
        wire, frame = framed
        size = len(frame) if len(frame) <= MAX_SERVER_FRAME // 4 else len(frame.encode())
        if size > MAX_SERVER_FRAME:
            raise SessionError(
                ErrorCode.INVALID_VALUE,
                f"Invalid value for '{param}': echoed in {wire['type']} it would take {size} bytes, over "
                f"the {MAX_SERVER_FRAME} bytes a server event may take; send less text (instructions, "
                "tool descriptions and schemas, content parts).",
                param,
            )

    def _send(self, event: dict[str, Any]) -> None:
        framed = self._frame(event)
        if framed is None:
            return
        event, frame = framed
        if len(frame) > MAX_SERVER_FRAME // 4 and len(frame.encode()) > MAX_SERVER_FRAME:
            log.error("dropping a %s event of %d bytes (over the frame limit)", event["type"], len(frame))
            event = error_event(
                new_id("event"),
                ErrorCode.SERVER_ERROR,
                f"The server's {event['type']} event was too large to send.",
                type="server_error",
            )
            frame = dumps(event)
        if self._stopped == "behind":  # being closed: nothing more is queued
            return
        self.queued_bytes += len(frame)
        if self.queued_bytes > self._max_queued:
            self._fell_behind()
            return
        self.outbox.put_nowait((frame, event["type"] == "error"))
        if self._held_timer is None and self._behind_reading():
            self._hold()

    def _unsent(self) -> int:
        """Bytes of the socket's send queue the client has not taken (0 when not watched)."""
        return (unsent_bytes(self._socket) or 0) if self._socket_mark else 0

    def _behind_reading(self) -> bool:
        """Past the hold mark in our queue, or in the socket's (the client's window closed)."""
        if self.queued_bytes > self._hold_mark:
            return True
        return self._socket_mark > 0 and self._unsent() > self._socket_mark

    def _caught_up(self) -> bool:
        """Both queues read down to half their marks."""
        return self.queued_bytes <= self._hold_mark // 2 and self._unsent() <= self._socket_mark // 2

    def _hold(self) -> None:
        """The client is behind: hold its responses; closed if it stays behind ``max_held_seconds``."""
        self.session.hold(True)
        self.service.clients_held += 1
        loop = asyncio.get_running_loop()
        self._held_timer = loop.call_later(self.service.config.max_held_seconds, self._held_too_long)
        if self._socket_mark:  # the socket drains without our writer noticing: look again
            self._poll = loop.call_later(_POLL, self._poll_release)

    def _poll_release(self) -> None:
        self._poll = None
        if self._held_timer is None:
            return
        if self._caught_up():
            self._release()
        else:
            self._poll = asyncio.get_running_loop().call_later(_POLL, self._poll_release)

    def _stop_hold(self) -> None:
        for timer in (self._held_timer, self._poll):
            if timer is not None:
                timer.cancel()
        self._held_timer = self._poll = None

    def _release(self) -> None:
        """The client has read both queues down to half their marks: its responses go on."""
        if self._held_timer is not None:
            self._stop_hold()
            self.session.hold(False)

    def _held_too_long(self) -> None:
        self._held_timer = None
        held = self.service.config.max_held_seconds
        log.warning(
            "session %s: client held %g s without reading its %d queued bytes (%d in its socket); closing it",
            self.session.id,
            held,
            self.queued_bytes,
            self._unsent(),
        )
        self._close_behind(
            f"client stayed behind for {held:g} s (over {self._hold_mark} bytes queued "
            f"or {self._socket_mark} unread in its socket)"
        )

    def _fell_behind(self) -> None:
        """The client is ``max_send_queue_bytes`` behind: drop what is queued and stop the reader;
        :meth:`run` cancels the responses and closes with 1008."""
        log.warning(
            "session %s: client fell %d bytes behind (limit %d); closing it",
            self.session.id,
            self.queued_bytes,
            self._max_queued,
        )
        self._close_behind(f"client fell over {self._max_queued} bytes behind")

    def _close_behind(self, reason: str) -> None:
        """Close the client for being behind (1008 with ``reason``), its queue dropped."""
        self._behind = reason
        self._stop_hold()
        self.service.slow_clients_closed += 1
        while not self.outbox.empty():
            self.outbox.get_nowait()
        self.queued_bytes = 0
        self._stop("behind")

    def _stop(self, reason: str) -> None:
        """Stop the reader (once) for ``reason``; :meth:`_read` tells it apart from others."""
        if self._stopped is None:
            self._stopped = reason
            if self._reader is not None:
                self._reader.cancel()

    def stop_for_shutdown(self) -> asyncio.Task[Any] | None:
        """Begin closing for a server shutdown; returns the connection's task to wait for."""
        self._stop("shutdown")
        return self._run_task

    def stop_for_drain(self) -> asyncio.Task[Any] | None:
        """Begin closing because the server drains (1001); returns the connection's task."""
        self._stop("drain")
        return self._run_task

    def _send_error(
        self,
        code: ErrorCode,
        message: str,
        *,
        param: str | None = None,
        client_event_id: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        self._send(
            error_event(
                new_id("event"), code, message, param=param, client_event_id=client_event_id, type=type
            )
        )

    def _error(self, exc: SessionError, client_event_id: str | None) -> None:
        # Expected (the client's doing): one line, never a traceback.
        log.info("session %s: refused an event: %s (param %s)", self.session.id, exc.code, exc.param)
        self._send_error(
            exc.code, exc.message, param=exc.param, client_event_id=client_event_id, type=exc.type
        )

    async def _writer(self) -> None:
        service = self.service
        while True:
            item = await self.outbox.get()
            if item is None:
                return
            frame, is_error = item
            await self.ws.send_text(frame)
            self.queued_bytes -= len(frame)
            if self._held_timer is not None and self._caught_up():
                self._release()
            service.events_sent += 1
            service.errors_sent += is_error

    # -- the connection ----------------------------------------------------------------------
    async def run(self) -> None:
        self._run_task = asyncio.current_task()
        writer = asyncio.create_task(self._writer(), name=f"writer {self.session.id}")
        close_code: int | None = None
        try:
            self.session.open()
            try:
                async with asyncio.timeout(self.service.config.max_session_seconds):
                    close_code = await self._read(writer)
            except TimeoutError:
                self._send_error(
                    ErrorCode.SESSION_EXPIRED,
                    "Your session hit the maximum duration of "
                    f"{self.service.config.max_session_seconds:g} seconds.",
                )
                close_code = CLOSE_GOING_AWAY
            # Responses still streaming end with response.done (cancelled); on shutdown without a
            # reason (neither of OpenAI's, turn_detected and client_cancelled, is what happened).
            ended_by_server = close_code == CLOSE_SERVICE_RESTART or self._stopped == "drain"
            await self.session.close(
                notify=close_code == CLOSE_NORMAL,
                reason=None if ended_by_server else "client_cancelled",
            )
            if close_code == CLOSE_POLICY:  # fell behind: nothing more is sent but the close
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
                await self._close(close_code, self._behind)
            elif close_code is not None:
                await self._drain(writer)
                await self._close(close_code, "server draining" if self._stopped == "drain" else "")
        finally:
            self._stop_hold()
            if not self.session.closed:
                await self.session.close(notify=False)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
            drop_traceback(writer)
            self._run_task = None  # the task refers back to this connection: no cycle left behind

    async def _close(self, code: int, reason: str = "") -> None:
        """Send the close frame; a client that does not read within ``CLOSE_WAIT_SECONDS`` is left
        to the server, which drops the socket when the handler returns."""
        with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError, TimeoutError):
            async with asyncio.timeout(CLOSE_WAIT_SECONDS):
                await self.ws.close(code, reason)

    async def _drain(self, writer: asyncio.Task[None]) -> None:
        self.outbox.put_nowait(None)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(writer), timeout=10)

    def _parse(self, text: str) -> tuple[ClientEvent, bytes | None]:
        event = parse_client_event(
            text, max_bytes=self.service.config.max_client_event_bytes, translate=self._to_ga
        )
        try:
            return event, decode_payload(event, self._limits)
        except ProtocolError as exc:
            exc.event_id = event.event_id
            raise

    async def _read(self, writer: asyncio.Task[None]) -> int | None:
        """Apply client frames until the client leaves (None) or asks to close (1000).

        The frames are awaited directly (no task and no ``asyncio.wait`` per frame: this runs for
        every audio chunk); the writer failing (the client is gone) and the idle limit stop the
        reading by cancelling this task, which is told apart from any other cancellation."""
        service = self.service
        idle = service.config.max_idle_seconds
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        self._reader = me
        self._last_read = loop.time()
        if idle is not None:
            self._idle_timer = loop.call_at(self._last_read + idle, self._check_idle)
        writer.add_done_callback(self._on_writer_done)
        try:
            if self._stopped is not None:  # stopped before reading began
                raise asyncio.CancelledError
            while True:
                message = await self.ws.receive()
                self._last_read = loop.time()
                if message["type"] == "websocket.disconnect":
                    return None
                service.events_received += 1
                text = message.get("text")
                if text is None:
                    self._send_error(
                        ErrorCode.INVALID_EVENT, "Binary frames are not accepted: send JSON text."
                    )
                    continue
                event_id: str | None = None
                try:
                    if len(text) > OFFLOAD_FRAME_CHARS:  # parse + base64 of MiBs: not on the loop
                        event, payload = await asyncio.to_thread(self._parse, text)
                    else:
                        event, payload = self._parse(text)
                    event_id = event.event_id
                    apply(event, self.session, new_id, payload)
                except CloseRequested:
                    return CLOSE_NORMAL
                except ProtocolError as exc:
                    self._error(exc, exc.event_id if exc.event_id is not None else event_id)
                except SessionError as exc:
                    self._error(exc, event_id)
                except Exception:
                    log.exception("session %s: failed to handle an event", self.session.id)
                    self._send_error(
                        ErrorCode.SERVER_ERROR,
                        "Internal error handling the event.",
                        client_event_id=event_id,
                        type="server_error",
                    )
        except asyncio.CancelledError:
            # Ours (see _stop) unless someone else cancelled us too.
            stopped = self._stopped
            if stopped is None or me.uncancel() > 0:
                raise
            if stopped == "writer":  # the client is gone
                return None
            if stopped == "behind":
                return CLOSE_POLICY
            if stopped == "shutdown":
                return CLOSE_SERVICE_RESTART
            if stopped == "drain":
                return CLOSE_GOING_AWAY
            self._send_error(
                ErrorCode.IDLE_TIMEOUT, f"No client event for {idle:g} seconds; closing the session."
            )
            return CLOSE_GOING_AWAY
        finally:
            self._reader = None
            writer.remove_done_callback(self._on_writer_done)
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

    def _on_writer_done(self, _: object) -> None:
        self._stop("writer")

    def _check_idle(self) -> None:
        """The idle timer: stop the reader once no frame came for ``max_idle_seconds``."""
        idle = self.service.config.max_idle_seconds
        assert idle is not None
        loop = asyncio.get_running_loop()
        due = self._last_read + idle
        if loop.time() >= due:
            self._idle_timer = None
            self._stop("idle")
        else:
            self._idle_timer = loop.call_at(due, self._check_idle)
