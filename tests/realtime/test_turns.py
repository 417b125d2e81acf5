"""Manual turns through the official SDK: event order, ids, modalities, formats, history."""

from __future__ import annotations

import base64

import numpy as np
from omnirt.codecs.audio import decode_audio, mulaw_encode, resample
from omnirt.stages.types import AudioPart, TextPart

from .conftest import AUDIO_RESPONSE_TAIL, MODEL, Server, pcm_b64, run, sdk_connect, text_item, tone

AUDIO_TURN_ORDER = [
    "input_audio_buffer.committed",
    "conversation.item.added",
    "conversation.item.done",
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
]


def test_session_created_holds_the_full_ga_session_with_openais_defaults(server: Server) -> None:
    """A new session starts as OpenAI's do: server VAD with create_response and
    interrupt_response on, no transcription or noise reduction, voice alloy, PCM 24 kHz."""

    async def main() -> dict:
        async with sdk_connect(server) as c:
            return c.events[0]

    session = run(main())["session"]
    assert session["type"] == "realtime" and session["object"] == "realtime.session"
    assert session["id"].startswith("sess_") and session["model"] == MODEL
    assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert session["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert session["audio"]["input"]["turn_detection"] == {
        "type": "server_vad",
        "threshold": 0.5,
        "prefix_padding_ms": 300,
        "silence_duration_ms": 500,
        "create_response": True,
        "interrupt_response": True,
        "idle_timeout_ms": None,
    }
    assert session["audio"]["input"]["transcription"] is None
    assert session["audio"]["input"]["noise_reduction"] is None
    assert session["audio"]["output"]["voice"] == "alloy" and session["audio"]["output"]["speed"] == 1.0
    assert session["output_modalities"] == ["audio"] and session["max_output_tokens"] == "inf"
    assert session["tools"] == [] and session["tool_choice"] == "auto"


def test_audio_turn_event_order_and_ids(server: Server) -> None:
    async def main() -> list[dict]:
        async with sdk_connect(server, manual=True) as c:
            await c.conn.input_audio_buffer.append(audio=pcm_b64(500))
            await c.conn.input_audio_buffer.commit(event_id="evt_commit")
            await c.conn.response.create()
            return await c.until("response.done")

    events = run(main())
    kinds = [e["type"] for e in events]
    assert kinds[: len(AUDIO_TURN_ORDER)] == AUDIO_TURN_ORDER
    assert kinds[-len(AUDIO_RESPONSE_TAIL) :] == AUDIO_RESPONSE_TAIL
    middle = kinds[len(AUDIO_TURN_ORDER) : -len(AUDIO_RESPONSE_TAIL)]
    assert set(middle) == {"response.output_audio_transcript.delta", "response.output_audio.delta"}
    committed, user_added, user_done, created = events[:4]
    user_id = committed["item_id"]
    assert user_added["item"]["id"] == user_done["item"]["id"] == user_id
    assert user_added["item"]["role"] == "user"
    assert user_added["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    response = created["response"]
    assert response["status"] == "in_progress" and response["object"] == "realtime.response"
    rid = response["id"]
    item_id = events[4]["item"]["id"]
    assert events[5]["previous_item_id"] == user_id and events[5]["item"]["status"] == "in_progress"
    assert events[6]["part"] == {"type": "audio", "transcript": ""}
    for e in events[4:-1]:
        if "response_id" in e:
            assert e["response_id"] == rid and e["output_index"] == 0
        if "item_id" in e:
            assert e["item_id"] == item_id and e["content_index"] == 0
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert transcript == "You said: 500 ms of audio."
    assert events[-5]["transcript"] == transcript
    assert events[-4]["part"]["type"] == "audio" and events[-4]["part"]["transcript"] == transcript
    for e in events[-3:-1]:
        assert e["item"]["content"] == [{"type": "output_audio", "transcript": transcript}]
        assert e["item"]["status"] == "completed"
    done = events[-1]["response"]
    assert (
        done["id"] == rid
        and done["status"] == "completed"
        and done["status_details"] == {"type": "completed"}
    )
    assert done["conversation_id"].startswith("conv_")
    assert [o["id"] for o in done["output"]] == [item_id]
    usage = done["usage"]
    assert usage["input_token_details"]["audio_tokens"] == 500 // 40
    assert usage["output_token_details"] == {"text_tokens": 6, "audio_tokens": 6}
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    # 6 words x 80 ms of 24 kHz PCM16, cut into deltas of 20-200 ms
    audio = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )
    assert len(audio) == 6 * 1920 * 2
    sizes = [len(base64.b64decode(e["delta"])) for e in events if e["type"] == "response.output_audio.delta"]
    assert all(20 * 48 <= s <= 200 * 48 for s in sizes[:-1]) and sizes[-1] <= 200 * 48
    # the model got the committed audio as float32 24 kHz
    request = server.pipeline.requests[-1]
    parts = [p for m in request.messages for p in m.parts]
    assert isinstance(parts[-1], AudioPart) and parts[-1].pcm.dtype == np.float32
    np.testing.assert_allclose(parts[-1].pcm, tone(500) / 32768.0, atol=1e-6)


def test_text_turn_uses_output_text_events(server: Server) -> None:
    async def main() -> list[dict]:
        async with sdk_connect(server) as c:
            await c.conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            updated = await c.recv()
            assert updated["type"] == "session.updated"
            assert updated["session"]["output_modalities"] == ["text"]
            await c.conn.conversation.item.create(item=text_item("hello"))
            await c.until("conversation.item.done")
            await c.conn.response.create()
            return await c.until("response.done")

    events = run(main())
    kinds = [e["type"] for e in events]
    assert "response.output_audio.delta" not in kinds
    assert kinds[:4] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
    ]
    assert kinds[-5:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert events[3]["part"]["type"] == "text"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "You said: hello." == events[-5]["text"]
    assert events[-3]["item"]["content"] == [{"type": "output_text", "text": text}]
    assert events[-1]["response"]["output_modalities"] == ["text"]
    assert server.pipeline.requests[-1].output_audio is False


def test_history_of_previous_turns_goes_into_every_request(server: Server) -> None:
    async def main() -> None:
        async with sdk_connect(server, manual=True) as c:
            await c.conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
            await c.until("session.updated")
            await c.conn.input_audio_buffer.append(audio=pcm_b64(200))
            await c.conn.input_audio_buffer.commit()
            await c.conn.response.create()
            await c.until("response.done")
            await c.conn.conversation.item.create(item=text_item("again"))
            await c.conn.response.create()
            await c.until("response.done")

    run(main())
    messages = server.pipeline.requests[-1].messages
    assert [m.role for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0].parts == (TextPart("Be brief."),)
    assert isinstance(messages[1].parts[0], AudioPart) and len(messages[1].parts[0].pcm) == 4800
    assert messages[2].parts == (TextPart("You said: 200 ms of audio."),)
    assert messages[3].parts == (TextPart("again"),)


def test_g711_input_and_output(server: Server) -> None:
    """mu-law in, A-law out: the model hears the decoded 24 kHz audio, the client gets 8 kHz A-law."""
    pcm8k = (resample(tone(400) / 32768.0, 24_000, 8_000) * 32767).astype(np.int16)

    async def main() -> list[dict]:
        async with sdk_connect(server, manual=True) as c:
            await c.conn.session.update(
                session={
                    "type": "realtime",
                    "audio": {
                        "input": {"format": {"type": "audio/pcmu"}},
                        "output": {"format": {"type": "audio/pcma"}},
                    },
                }
            )
            updated = await c.until("session.updated")
            assert updated[-1]["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}
            assert updated[-1]["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
            await c.conn.input_audio_buffer.append(audio=base64.b64encode(mulaw_encode(pcm8k)).decode())
            await c.conn.input_audio_buffer.commit()
            await c.conn.response.create()
            return await c.until("response.done")

    events = run(main())
    heard = [p for m in server.pipeline.requests[-1].messages for p in m.parts][-1]
    assert isinstance(heard, AudioPart) and abs(len(heard.pcm) - 9600) <= 1
    reference = tone(400) / 32768.0
    assert np.corrcoef(heard.pcm[200:-200], reference[200:-200])[0, 1] > 0.98
    assert events[-1]["response"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    out = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    words = len("You said: 400 ms of audio.".split())
    assert abs(len(out) - words * 80 * 8) <= 8  # one byte per 8 kHz sample
    decoded = decode_audio(out, "audio/pcma")  # back at 24 kHz: the 440 Hz tone of the echo pipeline
    spectrum = np.abs(np.fft.rfft(decoded[2400:-2400]))
    peak_hz = np.argmax(spectrum) * 24_000 / len(decoded[2400:-2400])
    assert abs(peak_hz - 440) < 10
