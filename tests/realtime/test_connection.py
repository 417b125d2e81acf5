"""Connection-level rules: auth, admission, duplex refusal, close, expiry, disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from omnirt.realtime.config import ServerConfig

from .conftest import Server, connect, run, running, text_item, wait_until

KEY = "sk-test-good"


@pytest.fixture(scope="module")
def guarded() -> Iterator[Server]:
    with running(ServerConfig(api_keys=[KEY], max_sessions=2), step_seconds=0.01) as s:
        yield s


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_bad_key_gets_the_upgrade_one_error_and_close_3000(guarded: Server) -> None:
    async def main() -> list[tuple[list[dict], int | None]]:
        out = []
        for headers in ({}, bearer("sk-wrong")):
            async with connect(guarded, headers=headers, expect_session=False) as c:
                code = await c.closed()
                out.append((c.events, code))
        return out

    for events, code in run(main()):
        assert code == 3000
        assert [e["type"] for e in events] == ["error"]
        assert events[0]["error"]["code"] == "invalid_api_key"
        assert events[0]["error"]["type"] == "invalid_request_error"


def test_good_key_by_header_or_browser_subprotocol(guarded: Server) -> None:
    async def main() -> list[str | None]:
        protocols = []
        async with connect(guarded, headers=bearer(KEY)) as c:
            protocols.append(c.ws.subprotocol)
        async with connect(guarded, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as c:
            protocols.append(c.ws.subprotocol)
        return protocols

    assert run(main()) == [None, "realtime"]


def test_sessions_over_max_get_resource_exhausted(guarded: Server) -> None:
    service = guarded.service

    async def main() -> tuple[list[dict], int | None, int]:
        async with connect(guarded, headers=bearer(KEY)), connect(guarded, headers=bearer(KEY)):
            assert service.active_sessions == 2
            async with connect(guarded, headers=bearer(KEY), expect_session=False) as third:
                code = await third.closed()
        # slots come back: a new session is admitted
        assert wait_until(lambda: service.active_sessions == 0)
        async with connect(guarded, headers=bearer(KEY)):
            active = service.active_sessions
        return third.events, code, active

    events, code, active = run(main())
    assert [e["error"]["code"] for e in events] == ["resource_exhausted"]
    assert code == 1013 and active == 1


def test_duplex_is_refused_not_silently_downgraded(server: Server) -> None:
    async def main() -> tuple[list[dict], int | None]:
        async with connect(server, query="&duplex=1", expect_session=False) as c:
            code = await c.closed()
            return c.events, code

    events, code = run(main())
    assert [e["error"]["code"] for e in events] == ["unsupported"] and code == 1008


def test_duplex_0_is_the_turn_based_handler(server: Server) -> None:
    async def main() -> None:
        async with connect(server, query="&duplex=0"):
            pass

    run(main())


def test_disconnect_mid_response_cancels_the_request_and_frees_the_slot(guarded: Server) -> None:
    service = guarded.service
    words = " ".join(f"w{i}" for i in range(400))

    async def main() -> str:
        async with connect(guarded, headers=bearer(KEY)) as c:
            await c.send({"type": "conversation.item.create", "item": text_item(words)})
            await c.send({"type": "response.create"})
            created = (await c.until("response.created"))[-1]
            await c.until("response.output_audio.delta")
            return created["response"]["id"]

    response_id = run(main())  # leaving the block closes the socket mid-response
    assert wait_until(lambda: service.active_sessions == 0)
    assert wait_until(lambda: response_id in guarded.pipeline.removed)
    assert wait_until(lambda: not guarded.pipeline.active and guarded.engine.stats.active == 0)


def test_session_close_finishes_in_flight_events_then_closes_1000(server: Server) -> None:
    async def main() -> tuple[list[str], int | None]:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item(" ".join(["x"] * 300))})
            await c.send({"type": "response.create"})
            await c.until("response.output_audio.delta")
            await c.send({"type": "session.close"})
            code = await c.closed()
            return [e["type"] for e in c.events], code

    kinds, code = run(main())
    assert code == 1000
    assert kinds[-2:] == ["response.done", "session.closed"]
    assert [e for e in kinds if e == "response.done"] == ["response.done"]


def test_session_expires_with_session_expired_and_close_1001() -> None:
    with running(ServerConfig(max_session_seconds=0.5)) as s:

        async def main() -> tuple[list[dict], int | None, float]:
            t0 = time.monotonic()
            async with connect(s) as c:
                code = await c.closed(timeout=5)
                return c.events, code, time.monotonic() - t0

        events, code, elapsed = run(main())
        assert code == 1001 and 0.4 < elapsed < 3
        assert [e["type"] for e in events] == ["session.created", "error"]
        assert events[-1]["error"]["code"] == "session_expired"
        assert wait_until(lambda: s.service.active_sessions == 0)


def test_counters_for_metrics(server: Server) -> None:
    service = server.service
    before = (service.sessions_total, service.events_received, service.events_sent, service.errors_sent)

    async def main() -> None:
        async with connect(server) as c:
            await c.send("{oops")
            await c.error()
            await c.send({"type": "input_audio_buffer.clear"})
            await c.recv()

    run(main())
    assert wait_until(lambda: service.active_sessions == 0)
    after = (service.sessions_total, service.events_received, service.events_sent, service.errors_sent)
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 2, 3, 1]


def test_pings_are_answered_while_a_response_streams(server: Server) -> None:
    async def main() -> float:
        async with connect(server) as c:
            await c.send({"type": "conversation.item.create", "item": text_item("hi " * 50)})
            await c.send({"type": "response.create"})
            pong = await c.ws.ping()
            latency = await asyncio.wait_for(pong, 2)
            await c.until("response.done")
            return latency

    assert run(main()) < 2
