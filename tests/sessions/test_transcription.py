"""Input audio transcription at the session layer: real Engine + a recording EchoPipeline.

Every event the session emits is also serialized and validated strictly against the SDK's models.
The echo pipeline answers a transcription request with ``You said: <its instruction>.``, so the
transcript shows what instruction reached the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import numpy as np
import pytest
from omnirt.realtime.protocol.server_events import Serializer, dumps
from omnirt.sessions import events as ev
from omnirt.sessions.config import SessionLimits
from omnirt.sessions.items import InputAudio, MessageItem
from omnirt.sessions.response import ResponseOptions
from omnirt.sessions.session import RealtimeSession
from omnirt.sessions.transcription import (
    BASE_TOKENS,
    TranscriptionRun,
    TranscriptionSettings,
    instruction,
    token_budget,
    transcription_request,
)
from omnirt.sessions.voices import VoiceCatalog
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.types import AudioPart, GenerationRequest, TextPart

from tests.fakes import EchoPipeline
from tests.realtime.conftest import tone, validate

_counter = itertools.count()


def ids(prefix: str) -> str:
    return f"{prefix}_{next(_counter)}"


def is_transcription(request_id: str) -> bool:
    return request_id.startswith("tr_")


class TranscribingPipeline(EchoPipeline):
    """Records requests and removals; can refuse transcriptions, or hold them (no step serves them
    until ``release`` is set)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests: list[GenerationRequest] = []
        self.removed: list[str] = []
        self.reject = False
        self.release = threading.Event()
        self.release.set()

    def prepare(self, request: GenerationRequest) -> Any:
        if self.reject and is_transcription(request.request_id):
            raise RequestRejected("this pipeline transcribes nothing")
        return super().prepare(request)

    def add(self, request: GenerationRequest, prepared: Any) -> None:
        self.requests.append(request)
        super().add(request, prepared)

    def step(self) -> list[tuple[str, Any]]:
        held = {}
        if not self.release.is_set():
            held = {rid: a for rid, a in self.active.items() if is_transcription(rid)}
            for rid in held:
                del self.active[rid]
        try:
            return super().step()
        finally:
            self.active.update(held)

    def remove(self, request_id: str) -> Any:
        self.removed.append(request_id)
        return super().remove(request_id)

    def transcriptions(self) -> list[GenerationRequest]:
        return [r for r in self.requests if is_transcription(r.request_id)]


class Harness:
    def __init__(self, transcription: dict[str, Any] | None = None) -> None:
        self.pipeline = TranscribingPipeline(step_seconds=0.002)
        self.engine = Engine(self.pipeline)
        self.events: list[object] = []
        self.session = RealtimeSession(
            EngineClient(self.engine),
            model="echo-test",
            limits=SessionLimits(voices=VoiceCatalog.for_model(("echo",))),
            emit=self._emit,
            new_id=ids,
        )
        self._serialize = Serializer(ids, lambda: self.session.config)
        self._event_ids: set[str] = set()
        if transcription is not None:
            self.session.update({"audio": {"input": {"transcription": transcription}}})

    def _emit(self, event: object) -> None:
        self.events.append(event)
        wire = self._serialize(event)  # type: ignore[arg-type]
        validate(dumps(wire), self._event_ids)

    async def __aenter__(self) -> Harness:
        self.engine.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close(notify=False)
        await asyncio.to_thread(self.engine.stop)

    def commit(self, ms: int = 500) -> MessageItem:
        self.session.append_audio(tone(ms).astype("<i2").tobytes())
        return self.session.commit_audio()

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    async def wait_for(self, kind: type, count: int = 1, timeout: float = 5.0) -> list[Any]:
        async with asyncio.timeout(timeout):
            while len(self.of(kind)) < count:
                await asyncio.sleep(0.005)
        return self.of(kind)


ENGLISH = {"model": "gpt-4o-mini-transcribe", "language": "en"}


def test_a_committed_item_gets_deltas_then_completed_and_keeps_its_transcript() -> None:
    async def main() -> None:
        async with Harness(ENGLISH) as h:
            item = h.commit(500)
            (done,) = await h.wait_for(ev.InputTranscriptionCompleted)
            kinds = [type(e).__name__ for e in h.events[1:]]  # after session.updated
            assert kinds[:3] == ["InputAudioCommitted", "ItemAdded", "ItemDone"]
            deltas = h.of(ev.InputTranscriptionDelta)
            assert kinds[3:] == ["InputTranscriptionDelta"] * 8 + ["InputTranscriptionCompleted"]
            assert {(d.item_id, d.content_index) for d in deltas} == {(item.id, 0)}
            assert (done.item_id, done.content_index) == (item.id, 0)
            assert done.transcript == "".join(d.delta for d in deltas)
            assert done.transcript == "You said: Transcribe the English audio into text.."
            part = item.content[0]
            assert isinstance(part, InputAudio) and part.transcript == done.transcript
            # usage: the echo counts a token per part and per 40 ms of audio, and each word
            assert (done.usage.input_text_tokens, done.usage.input_audio_tokens) == (2, 12)
            assert done.usage.output_text_tokens == 8
            # the engine got one text-only greedy request: the item's audio, then the instruction
            (request,) = h.pipeline.transcriptions()
            assert request.output_audio is False and request.temperature == 0.0
            assert request.max_output_tokens == token_budget(len(part.audio), 512) == BASE_TOKENS + 5
            (message,) = request.messages
            audio, text = message.parts
            assert message.role == "user" and isinstance(audio, AudioPart) and isinstance(text, TextPart)
            assert np.array_equal(audio.pcm, part.audio)
            assert text.text == "Transcribe the English audio into text."
            assert h.session.transcriptions == {}

    asyncio.run(main())


def test_without_transcription_nothing_is_transcribed() -> None:
    async def main() -> None:
        async with Harness() as h:
            item = h.commit(300)
            h.session.create_response(ResponseOptions(output_modalities=["text"]))
            await h.wait_for(ev.ResponseDone)
            await asyncio.sleep(0.05)
            assert h.pipeline.transcriptions() == [] and len(h.pipeline.requests) == 1
            assert not h.of(ev.InputTranscriptionDelta) and not h.of(ev.InputTranscriptionCompleted)
            assert item.content[0].transcript is None  # type: ignore[union-attr]

    asyncio.run(main())


def test_the_reply_never_waits_for_the_transcription() -> None:
    """With the transcription held in the engine, the reply starts and completes; the transcript
    arrives afterwards. The next reply's context has the user's audio and no transcript text."""

    async def main() -> None:
        async with Harness(ENGLISH) as h:
            h.pipeline.release.clear()
            item = h.commit(500)
            h.session.create_response(ResponseOptions(output_modalities=["text"]))
            (done,) = await h.wait_for(ev.ResponseDone)
            assert done.response.status == "completed"
            assert not h.of(ev.InputTranscriptionDelta) and item.id in h.session.transcriptions
            h.pipeline.release.set()
            await h.wait_for(ev.InputTranscriptionCompleted)
            assert h.events.index(done) < h.events.index(h.of(ev.InputTranscriptionDelta)[0])
            h.session.create_response(ResponseOptions(output_modalities=["text"]))
            await h.wait_for(ev.ResponseDone, 2)
            replies = [r for r in h.pipeline.requests if not is_transcription(r.request_id)]
            assert len(replies) == 2
            user = [m for m in replies[1].messages if m.role == "user"]
            assert len(user) == 1 and [type(p) for p in user[0].parts] == [AudioPart]

    asyncio.run(main())


def test_deleting_the_item_mid_transcription_cancels_it_silently() -> None:
    async def main() -> None:
        async with Harness(ENGLISH) as h:
            h.pipeline.release.clear()
            item = h.commit(500)
            async with asyncio.timeout(5):  # admitted by the engine, held there
                while not h.pipeline.transcriptions():
                    await asyncio.sleep(0.005)
            (request,) = h.pipeline.transcriptions()
            h.session.delete_item(item.id)
            assert isinstance(h.events[-1], ev.ItemDeleted) and h.session.transcriptions == {}
            count = len(h.events)
            h.pipeline.release.set()
            async with asyncio.timeout(5):  # the engine drops the request at its next step
                while request.request_id not in h.pipeline.removed:
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.1)
            assert len(h.events) == count
            assert h.engine.stats.requests_cancelled == 1

    asyncio.run(main())


def test_deleting_after_some_deltas_sends_nothing_more() -> None:
    async def main() -> None:
        async with Harness(ENGLISH) as h:
            h.pipeline.step_seconds = 0.02
            item = h.commit(500)
            await h.wait_for(ev.InputTranscriptionDelta)
            h.session.delete_item(item.id)
            count = len(h.events)
            await asyncio.sleep(0.3)
            assert len(h.events) == count and isinstance(h.events[-1], ev.ItemDeleted)
            assert not h.of(ev.InputTranscriptionCompleted)

    asyncio.run(main())


def test_closing_the_session_cancels_transcriptions() -> None:
    async def main() -> None:
        async with Harness(ENGLISH) as h:
            h.pipeline.release.clear()
            h.commit(500)
            async with asyncio.timeout(5):
                while not h.pipeline.transcriptions():
                    await asyncio.sleep(0.005)
            count = len(h.events)
            await h.session.close(notify=False)
            h.pipeline.release.set()
            async with asyncio.timeout(5):
                while h.pipeline.active:
                    await asyncio.sleep(0.005)
            assert len(h.events) == count and h.session.transcriptions == {}

    asyncio.run(main())


def test_a_refused_transcription_fails_alone() -> None:
    async def main() -> None:
        async with Harness(ENGLISH) as h:
            h.pipeline.reject = True
            item = h.commit(500)
            h.session.create_response(ResponseOptions(output_modalities=["text"]))
            (failed,) = await h.wait_for(ev.InputTranscriptionFailed)
            (done,) = await h.wait_for(ev.ResponseDone)
            assert (failed.item_id, failed.content_index) == (item.id, 0)
            assert failed.error == ev.TranscriptionError(
                "transcription_error", "invalid_value", "this pipeline transcribes nothing"
            )
            assert done.response.status == "completed"
            assert not h.of(ev.InputTranscriptionCompleted) and not h.of(ev.InputTranscriptionDelta)
            assert item.content[0].transcript is None  # type: ignore[union-attr]
            # the session goes on: the next commit is transcribed once the engine accepts it
            h.pipeline.reject = False
            second = h.commit(300)
            (completed,) = await h.wait_for(ev.InputTranscriptionCompleted)
            assert completed.item_id == second.id

    asyncio.run(main())


def test_an_engine_refusing_at_submit_gives_failed() -> None:
    class Refusing:
        def submit(self, request: object) -> object:
            raise RuntimeError("engine stopped")

    async def main() -> None:
        out: list[object] = []
        session = RealtimeSession(Refusing(), model="m", limits=SessionLimits(), emit=out.append, new_id=ids)
        session.update({"audio": {"input": {"transcription": {}}}})
        session.append_audio(tone(200).astype("<i2").tobytes())
        item = session.commit_audio()
        failed = out[-1]
        assert isinstance(failed, ev.InputTranscriptionFailed) and failed.item_id == item.id
        assert failed.error.code == "server_error" and "engine stopped" in failed.error.message
        assert session.transcriptions == {}

    asyncio.run(main())


def test_no_audio_completes_empty_without_the_engine() -> None:
    class Unused:
        def submit(self, request: object) -> object:
            raise AssertionError("nothing to transcribe: the engine is not asked")

    async def main() -> None:
        out: list[object] = []
        part = InputAudio(np.zeros(0, np.float32))
        request = transcription_request("tr_x", part.audio, TranscriptionSettings(), max_tokens=64)
        run = TranscriptionRun(
            "item_1", 0, part, request, client=Unused(), emit=out.append, on_done=out.append
        )
        run.start()
        completed, finished = out
        assert isinstance(completed, ev.InputTranscriptionCompleted) and completed.transcript == ""
        assert finished is run and part.transcript == ""

    asyncio.run(main())


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, "Transcribe the audio into text."),
        ({"model": "whisper-1", "language": "", "prompt": "  "}, "Transcribe the audio into text."),
        ({"language": "fr"}, "Transcribe the French audio into text."),
        ({"language": "pt-BR"}, "Transcribe the Portuguese audio into text."),
        ({"language": "Klingon"}, "Transcribe the Klingon audio into text."),
        (
            {"language": "en", "prompt": "Names: Qwen, omnirt.", "keywords": ["Triton", " "]},
            "Transcribe the English audio into text.\n"
            "Context that may help with spelling and vocabulary (do not transcribe it): Names: Qwen, "
            "omnirt.\nWords and names that may occur: Triton.",
        ),
    ],
)
def test_instruction_honours_language_prompt_and_keywords(config: dict[str, Any], expected: str) -> None:
    assert instruction(TranscriptionSettings.of(config)) == expected


def test_token_budget_grows_with_the_audio_and_stays_under_the_cap() -> None:
    assert token_budget(0, 512) == BASE_TOKENS
    assert token_budget(24_000, 512) == BASE_TOKENS + 10
    assert token_budget(24_000 * 3 + 1, 512) == BASE_TOKENS + 31
    assert token_budget(24_000 * 600, 512) == 512
    assert token_budget(24_000, 4) == 4
