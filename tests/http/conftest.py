"""A real server on loopback around the real Engine with the fast EchoPipeline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from openai import AsyncOpenAI
from starlette.applications import Starlette

from tests.diffusion_fakes import FakeImagePipeline, FakeVideoPipeline
from tests.fakes import EchoPipeline
from tests.server import serve

T = TypeVar("T")
MODEL = "echo-test"


@dataclass
class Server:
    base_url: str
    app: Starlette
    engine: Engine
    pipeline: EchoPipeline

    def openai(self, api_key: str = "unused") -> AsyncOpenAI:
        """The official SDK pointed at this server; no retries, so every status is seen as is."""
        return AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=20)

    def http(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=20, **kwargs)


@contextlib.contextmanager
def running(
    pipeline: EchoPipeline | None = None, config: ServerConfig | None = None, *, max_waiting: int = 256
) -> Iterator[Server]:
    pipeline = pipeline or EchoPipeline()
    engine = Engine(pipeline, max_waiting=max_waiting)
    app = create_app(EngineClient(engine), config or ServerConfig())
    with serve(app) as base_url:
        yield Server(base_url, app, engine, pipeline)


@dataclass
class MediaServer(Server):
    image: FakeImagePipeline
    video: FakeVideoPipeline


@contextlib.contextmanager
def running_media(
    image: FakeImagePipeline | None = None,
    video: FakeVideoPipeline | None = None,
    config: ServerConfig | None = None,
) -> Iterator[MediaServer]:
    """Speech (echo), image and video fakes in one engine, as ``omnirt serve`` runs them."""
    echo, image, video = EchoPipeline(), image or FakeImagePipeline(), video or FakeVideoPipeline()
    engine = Engine([echo, image, video])
    app = create_app(EngineClient(engine), config or ServerConfig(vad_preload=False))
    with serve(app) as base_url:
        yield MediaServer(base_url, app, engine, echo, image, video)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running() as s:
        yield s
