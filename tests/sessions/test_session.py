"""The session layer alone: real Engine + EchoPipeline, no WebSocket; events as typed objects."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from omnirt.codecs.audio import FormatType
from omnirt.sessions import events as ev
from omnirt.sessions.config import SessionConfig, SessionLimits
from omnirt.sessions.conversation import Conversation
from omnirt.sessions.errors import ErrorCode, SessionError
from omnirt.sessions.input_buffer import InputAudioBuffer
from omnirt.sessions.items import InputText, MessageItem, OutputAudio
from omnirt.sessions.manager import SessionManager
from omnirt.sessions.response import ResponseOptions
from omnirt.sessions.session import RealtimeSession
from omnirt.sessions.streaming import MAX_DELTA_MS, MIN_DELTA_MS, AudioChunker
from omnirt.sessions.voices import OPENAI_VOICES, VoiceCatalog
from omnirt.stages.engine import Engine, EngineClient

from tests.fakes import EchoPipeline

_counter = itertools.count()


def ids(prefix: str) -> str:
    return f"{prefix}_{next(_counter)}"


class Harness:
    def __init__(self, step_seconds: float = 0.002) -> None:
        self.pipeline = EchoPipeline(step_seconds=step_seconds)
        self.engine = Engine(self.pipeline)
        self.events: list[object] = []
        self.session = RealtimeSession(
            EngineClient(self.engine),
            model="echo-test",
            limits=SessionLimits(max_input_buffer_bytes=48_000, voices=VoiceCatalog.for_model(("echo",))),
            emit=self.events.append,
            new_id=ids,
        )

    async def __aenter__(self) -> Harness:
        self.engine.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close(notify=False)
        await asyncio.to_thread(self.engine.stop)

    async def wait_done(self, timeout: float = 5.0) -> ev.ResponseDone:
        async with asyncio.timeout(timeout):
            while not any(isinstance(e, ev.ResponseDone) for e in self.events):
                await asyncio.sleep(0.005)
        return next(e for e in self.events if isinstance(e, ev.ResponseDone))


def user_text(text: str) -> MessageItem:
    return MessageItem(ids("item"), "user", [InputText(text)])


def test_cancel_closes_the_response_before_returning() -> None:
    async def main() -> list[object]:
        async with Harness() as h:
            h.session.create_item(user_text(" ".join(["w"] * 200)))
            h.session.create_response()
            async with asyncio.timeout(5):
                while not any(isinstance(e, ev.OutputAudioDelta) for e in h.events):
                    await asyncio.sleep(0.005)
            h.session.cancel_response()
            count = len(h.events)
            assert isinstance(h.events[-1], ev.ResponseDone) and h.session.active is None
            await asyncio.sleep(0.1)  # the engine would still have produced more
            assert len(h.events) == count
            # a new response can start at once
            h.session.create_response(ResponseOptions(output_modalities=["text"]))
            return h.events

    events = asyncio.run(main())
    done = [e for e in events if isinstance(e, ev.ResponseDone)]
    assert done[0].response.status == "cancelled" and done[0].response.reason == "client_cancelled"


def test_second_response_refused_and_session_unchanged() -> None:
    async def main() -> None:
        async with Harness() as h:
            h.session.create_item(user_text("hello there"))
            first = h.session.create_response()
            with pytest.raises(SessionError) as info:
                h.session.create_response()
            assert info.value.code == ErrorCode.ACTIVE_RESPONSE
            done = await h.wait_done()
            assert done.response is first and first.status == "completed"
            assert [i.role for i in h.session.conversation] == ["user", "assistant"]  # type: ignore[union-attr]

    asyncio.run(main())


def test_close_cancels_engine_requests() -> None:
    async def main() -> None:
        async with Harness() as h:
            h.session.create_item(user_text(" ".join(["w"] * 500)))
            h.session.create_response()
            await asyncio.sleep(0.05)
            await h.session.close(notify=False)
            async with asyncio.timeout(5):  # the engine thread drops it at its next step
                while h.pipeline.active or h.engine.stats.requests_cancelled != 1:
                    await asyncio.sleep(0.005)

    asyncio.run(main())


def test_config_merge_is_deep_and_null_clears() -> None:
    limits = SessionLimits(voices=VoiceCatalog.for_model(("a", "b")))
    c = SessionConfig(model="m", voice="a")
    c = c.merged(
        {"instructions": "x", "audio": {"input": {"format": {"type": "audio/pcmu"}}}},
        limits=limits,
        voice_locked=False,
    )
    c = c.merged({"audio": {"output": {"voice": "b", "speed": 1.1}}}, limits=limits, voice_locked=False)
    assert (c.instructions, c.input_format, c.voice, c.speed) == ("x", "audio/pcmu", "b", 1.1)
    c = c.merged({"audio": {"input": None}, "instructions": None}, limits=limits, voice_locked=True)
    assert (c.instructions, c.input_format, c.voice, c.speed) == ("", "audio/pcm", "b", 1.1)


def test_openai_voice_names_are_aliases_of_the_model_voices() -> None:
    """By default OpenAI's ten names map onto the model's voices in turn; overrides win; the
    model's own names win over an alias; a bad override is refused at start."""
    catalog = VoiceCatalog.for_model(("a", "b", "c"))
    assert [catalog.resolve(n, "p") for n in OPENAI_VOICES] == list("abcabcabca")
    assert catalog.resolve("b", "p") == "b" and catalog.names[:3] == ("a", "b", "c")
    with pytest.raises(SessionError) as info:
        catalog.resolve("nobody", "session.audio.output.voice")
    assert (info.value.code, info.value.param) == (ErrorCode.INVALID_VALUE, "session.audio.output.voice")
    assert "'alloy'" in info.value.message and "'a'" in info.value.message
    custom = VoiceCatalog.for_model(("echo", "alto"), {"alloy": "alto", "narrator": "echo"})
    assert custom.resolve("echo", "p") == "echo"  # the model's own voice, not OpenAI's echo alias
    assert "echo" not in custom.aliases and custom.resolve("alloy", "p") == "alto"
    assert custom.resolve("narrator", "p") == "echo" and custom.resolve("ash", "p") == "alto"
    for bad in ({"alloy": "nobody"}, {"echo": "alto"}, {"": "alto"}):
        with pytest.raises(ValueError):
            VoiceCatalog.for_model(("echo", "alto"), bad)
    anything = VoiceCatalog()  # a model that lists no voices: names pass through
    assert anything.resolve("whatever", "p") == "whatever" and not anything.aliases


def test_voice_lock_compares_the_voice_heard() -> None:
    """After audio, another name of the same model voice is accepted (shown as asked); a name
    of another voice gets cannot_update_voice and the config is unchanged."""
    limits = SessionLimits(voices=VoiceCatalog.for_model(("a", "b")))
    c = SessionConfig(model="m", voice="alloy")  # alloy -> a
    same = c.merged({"audio": {"output": {"voice": "a"}}}, limits=limits, voice_locked=True)
    assert same.voice == "a"
    with pytest.raises(SessionError) as info:
        patch = {"audio": {"output": {"voice": "ash"}}, "instructions": "x"}
        c.merged(patch, limits=limits, voice_locked=True)
    assert info.value.code == ErrorCode.CANNOT_UPDATE_VOICE and c.voice == "alloy" and c.instructions == ""


@pytest.mark.parametrize("push_to_talk", [False, True])
def test_open_without_a_vad_starts_manual_and_says_why(push_to_talk: bool) -> None:
    """A new session asks for OpenAI's default server VAD; with no VAD available it starts with
    manual turns and reports server_vad_initialization_failed after session.created (a
    push-to-talk session starts with manual turns and no error)."""
    out: list[object] = []
    session = RealtimeSession(
        object(),  # type: ignore[arg-type]
        model="m",
        limits=SessionLimits(),
        emit=out.append,
        new_id=ids,
        vad=None,
        push_to_talk=push_to_talk,
    )
    session.open()
    assert isinstance(out[0], ev.SessionCreated) and out[0].config.turn_detection is None
    assert out[0].config.voice == "alloy"
    if push_to_talk:
        assert len(out) == 1
    else:
        assert len(out) == 2 and isinstance(out[1], ev.ErrorReported)
        assert (out[1].code, out[1].type) == (ErrorCode.SERVER_VAD_INIT_FAILED, "server_error")


def test_input_buffer_counts_wire_duration_and_refuses_without_side_effects() -> None:
    buf = InputAudioBuffer("audio/pcmu", max_bytes=48_000)  # 1 s
    buf.append(b"\xff" * 4000)  # 500 ms of 8 kHz mu-law
    assert buf.duration_ms == 500
    with pytest.raises(SessionError) as info:
        buf.append(b"\xff" * 4800)  # 600 ms more: over 1 s
    assert info.value.code == ErrorCode.INPUT_BACKPRESSURE and buf.duration_ms == 500
    buf.set_format("audio/pcm")
    with pytest.raises(SessionError):
        buf.append(b"\x00" * 3)
    buf.append(b"\x00" * 4800)  # 100 ms of PCM16 at 24 kHz
    assert buf.duration_ms == 600
    audio = buf.commit()
    assert abs(len(audio) - 14_400) <= 2 and buf.duration_ms == 0
    with pytest.raises(SessionError) as info:
        buf.commit()
    assert info.value.code == ErrorCode.COMMIT_EMPTY


def test_output_audio_truncation_keeps_what_was_heard() -> None:
    part = OutputAudio(transcript="one two three")
    for chars in (3, 7, 13):
        part.append(np.ones(2400, np.int16), chars)  # 100 ms per word
    part.truncate(250)
    assert part.samples == 6000 and len(part.audio) == 6000 and part.transcript == "one two"
    part.append(np.ones(2400, np.int16), 20)  # frozen: later stream output is not stored
    assert part.samples == 6000


def test_truncation_at_the_rounded_up_end_keeps_all_the_audio() -> None:
    """7,120 samples are 296.67 ms: a truncation at 297 (the received length rounded up, as
    openai-agents bounds it) keeps everything; 298 is past the end."""

    async def main() -> OutputAudio:
        async with Harness() as h:
            part = OutputAudio(transcript="hello")
            part.append(np.ones(7120, np.int16), 5)
            h.session.conversation.insert(MessageItem("item_1", "assistant", [part]))
            assert (part.duration_ms, part.end_ms) == (296, 297)
            with pytest.raises(SessionError) as info:
                h.session.truncate_item("item_1", 0, 298)
            assert info.value.code == ErrorCode.INVALID_VALUE and "297 ms" in info.value.message
            h.session.truncate_item("item_1", 0, 297)
            return part

    part = asyncio.run(main())
    assert part.samples == 7120 and part.transcript == "hello"


def test_conversation_placement() -> None:
    conv = Conversation("conv_1")
    a, b, c = (MessageItem(x, "user", []) for x in "abc")
    assert conv.insert(a) is None
    assert conv.insert(c) == "a"
    assert conv.insert(b, "a") == "a"
    assert [i.id for i in conv] == ["a", "b", "c"] and conv.previous_id("c") == "b"
    with pytest.raises(SessionError) as info:
        conv.insert(MessageItem("a", "user", []))
    assert info.value.code == ErrorCode.ITEM_CREATE_DUPLICATE_ID
    with pytest.raises(SessionError) as info:
        conv.insert(MessageItem("d", "user", []), "nope")
    assert info.value.code == ErrorCode.ITEM_CREATE_INVALID_PREVIOUS_ID and len(conv) == 3


@pytest.mark.parametrize("fmt", ["audio/pcm", "audio/pcmu"])
def test_audio_chunker_bounds(fmt: FormatType) -> None:
    chunker = AudioChunker(fmt)
    per_ms = chunker.per_ms
    out = []
    for size in (5, 10, 700, 3, 250, 90):
        out += chunker.push(b"\x00" * size * per_ms)
    out += chunker.flush()
    assert sum(len(c) for c in out) == 1058 * per_ms
    assert all(MIN_DELTA_MS * per_ms <= len(c) <= MAX_DELTA_MS * per_ms for c in out[:-1])
    assert all(len(c) % chunker.sample_bytes == 0 for c in out)


def test_manager_admits_up_to_max() -> None:
    manager = SessionManager(2)
    first, second = manager.admit(), manager.admit()
    assert first and second and manager.admit() is None and manager.active == 2
    first.release()
    first.release()  # idempotent
    assert manager.active == 1 and manager.admit() is not None and manager.total == 3


def test_engine_refusing_at_submit_still_ends_the_response() -> None:
    class Refusing:
        def submit(self, request: object) -> object:
            raise RuntimeError("engine stopped")

    async def main() -> list[object]:
        out: list[object] = []
        session = RealtimeSession(Refusing(), model="m", limits=SessionLimits(), emit=out.append, new_id=ids)
        session.create_item(user_text("hi"))
        response = session.create_response()
        assert response.status == "failed" and "engine stopped" in response.error.message  # type: ignore[union-attr]
        assert session.active is None and not session.runs
        return out

    events = asyncio.run(main())
    assert [type(e).__name__ for e in events] == ["ItemAdded", "ItemDone", "ResponseCreated", "ResponseDone"]
