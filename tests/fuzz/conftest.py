"""The fuzzers' server: ``omnirt serve --device cpu`` (the embedded speech, image and video models)
in a process of its own on loopback, one per test module, and what every example checks on it.

Hypothesis runs at a fixed seed (``derandomize``) with a fixed example budget, no deadline and no
example database, so a CI run is the same every time; its caches go to the system's temporary
folder, not into the repository.
``OMNIRT_FUZZ_EXAMPLES=N`` runs each fuzz test with N examples instead, and ``OMNIRT_FUZZ_RANDOM=1``
draws them at random (or from pytest's ``--hypothesis-seed``): a longer local hunt.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.server import serve_cli_process

try:
    from hypothesis import HealthCheck, settings
    from hypothesis.configuration import set_hypothesis_home_dir
except ModuleNotFoundError:  # the dev extra is not installed: skipped here, a failure under CI
    if os.environ.get("CI"):
        raise
    collect_ignore_glob = ["test_*.py"]
else:
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "omnirt-hypothesis")

#: Lines the server logs only when something went wrong on its side: a traceback, or a record
#: at ERROR or CRITICAL (ours: ``2026-01-01 00:00:00,000 ERROR name: ...``; uvicorn's
#: ``ERROR:    ...``). Client mistakes are logged at INFO, one line each.
SERVER_FAULT = re.compile(
    r"^(Traceback \(most recent call last\)|\S+ \S+ (ERROR|CRITICAL) |(ERROR|CRITICAL):)", re.MULTILINE
)


def strict_json(text: str | bytes) -> Any:
    """Parse what the server sent as strict JSON: no ``NaN`` / ``Infinity`` tokens (which Python's
    parser reads, and a browser's or the SDKs' do not)."""

    def refuse(token: str) -> Any:
        raise AssertionError(f"the server sent {token}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def fuzz_settings(examples: int) -> Callable[[Any], Any]:
    """Hypothesis settings for a fuzz test: ``examples`` examples (``OMNIRT_FUZZ_EXAMPLES``
    overrides), derandomized (unless ``OMNIRT_FUZZ_RANDOM``), no deadline, no database."""
    return settings(
        max_examples=int(os.environ.get("OMNIRT_FUZZ_EXAMPLES") or examples),
        derandomize=not os.environ.get("OMNIRT_FUZZ_RANDOM"),
        database=None,
        deadline=None,
        print_blob=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ],
    )


@dataclass
class LiveServer:
    """A running ``omnirt serve``: its URL, process and log."""

    base_url: str
    process: psutil.Process
    log: Path
    _read: int = 0
    #: RSS (bytes, the server and its child processes) once warmed up; set by the module.
    baseline_rss: int | None = None

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://") + "/v1/realtime"

    def rss(self) -> int:
        """Resident memory of the server and its children (the VAD process), in bytes."""
        procs = [self.process, *self.process.children(recursive=True)]
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def settled_rss(self, seconds: float = 2.0) -> int:
        """The least RSS seen over ``seconds`` (work finishing frees what it held)."""
        samples = []
        for _ in range(10):
            samples.append(self.rss())
            time.sleep(seconds / 10)
        return min(samples)

    def new_log(self) -> str:
        """What the server logged since the last call."""
        with self.log.open("rb") as f:
            f.seek(self._read)
            data = f.read()
        self._read += len(data)
        return data.decode("utf-8", "replace")

    def assert_no_fault_logged(self, until: str | None = None, timeout: float = 15.0) -> None:
        """Nothing at ERROR and no traceback in the log since the last check; with ``until``, the
        log is read up to that text first (a connection's end: all it caused is logged by then)."""
        text = self.new_log()
        deadline = time.monotonic() + timeout
        while until is not None and until not in text and time.monotonic() < deadline:
            time.sleep(0.02)
            text += self.new_log()
        match = SERVER_FAULT.search(text)
        assert match is None, (
            f"the server logged a fault:\n{text[max(0, match.start() - 2000) : match.start() + 4000]}"
        )
        assert until is None or until in text, f"{until!r} not logged within {timeout} s"

    def assert_alive(self) -> None:
        assert self.process.is_running() and self.process.status() != psutil.STATUS_ZOMBIE, "server died"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the embedded models (built by the first server, read by the next)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("log") / "serve.log"
    args = ["--device", "cpu", "--max-sessions", "4", "--log-level", "info"]
    with serve_cli_process(args, cache=model_cache, log=log) as (base, proc):
        server = LiveServer(base, psutil.Process(proc.pid), log)
        server.new_log()  # start-up lines are not the fuzzer's business
        yield server
