"""The ``omnirt`` command: help, argument errors, configuration, and a real ``omnirt serve``."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from omnirt.realtime.cli import build_parser, config_from_args, main, ws_max_size
from omnirt.realtime.config import ServerConfig
from openai import AsyncOpenAI

from tests.server import free_port

OMNIRT = shutil.which("omnirt", path=str(Path(sys.executable).parent)) or "omnirt"


def test_serve_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    options = (
        "--model --load-format --host --port --api-key --max-sessions --voice-alias --device "
        "--no-cuda-graphs --prefill-chunk --max-context --log-level --allowed-origin --metrics-host"
    )
    for option in options.split():
        assert option in out


def test_console_script_is_installed_and_answers_help() -> None:
    done = subprocess.run([OMNIRT, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: omnirt serve" in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required: COMMAND"),
        (["launch"], "invalid choice: 'launch'"),
        (["serve", "--port", "http"], "not a port number: 'http'"),
        (["serve", "--port", "70000"], "between 1 and 65535"),
        (["serve", "--max-sessions", "0"], "must be at least 1"),
        (["serve", "--device", "tpu"], "device must be cpu, cuda or cuda:N"),
        (["serve", "--model", "/no/such/checkpoint"], "neither 'demo' nor an existing local path"),
        (["serve", "--log-level", "loud"], "invalid choice: 'loud'"),
        (["serve", "--load-format", "pt"], "invalid choice: 'pt'"),
        (["serve", "--bogus"], "unrecognized arguments: --bogus"),
        (["serve", "--voice-alias", "alloy"], "expected NAME=VOICE"),
        (["serve", "--voice-alias", "=ethan"], "expected NAME=VOICE"),
        (["serve", "--allowed-origin", "app.example"], "expected an origin such as"),
        (["serve", "--allowed-origin", "https://app.example/path"], "expected an origin such as"),
        (["serve", "--metrics-host", "9100"], "expected HOST:PORT"),
        (["serve", "--prefill-chunk", "8"], "at least 16"),
        (["serve", "--prefill-chunk", "many"], "at least 16"),
        (["serve", "--max-context", "63"], "at least 64"),
        (["serve", "--max-context", "lots"], "not an integer"),
        (["serve", "--batch-slice-ms", "-1"], "expected whole milliseconds from 0 to 10000"),
        (["serve", "--batch-slice-ms", "2.5"], "expected whole milliseconds from 0 to 10000"),
        (["serve", "--metrics-host", "127.0.0.1:99999"], "expected HOST:PORT"),
    ],
)
def test_argument_errors_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_merges_keys_from_flags_and_environment(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tmp_path),
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--api-key",
            "b",
            "--api-key",
            "c",
            "--max-sessions",
            "3",
            "--device",
            "cuda:1",
            "--voice-alias",
            "alloy=Ethan",
            "--voice-alias",
            " narrator = Chelsie ",
        ]
    )
    config = config_from_args(args, {"OMNIRT_API_KEYS": " a, b ,,"})
    assert config.api_keys == ["a", "b", "c"]
    assert (config.host, config.port, config.models, config.max_sessions) == (
        "0.0.0.0",
        9001,
        [str(tmp_path)],
        3,
    )
    assert args.device == "cuda:1"
    assert config.voice_aliases == {"alloy": "Ethan", "narrator": "Chelsie"}
    defaults = config_from_args(build_parser().parse_args(["serve"]), {})
    assert (defaults.models, defaults.api_keys, defaults.port) == ([], [], 8000)
    several = build_parser().parse_args(["serve", "--model", "demo", "--model", str(tmp_path)])
    assert config_from_args(several, {}).models == ["demo", str(tmp_path)]
    assert defaults.vad_preload and defaults.cuda_graphs  # omnirt serve starts the VAD with the app
    eager = config_from_args(build_parser().parse_args(["serve", "--no-cuda-graphs"]), {})
    assert not eager.cuda_graphs
    chunked = config_from_args(build_parser().parse_args(["serve", "--prefill-chunk", "256"]), {})
    assert chunked.prefill_chunk == 256 and defaults.prefill_chunk == 512
    whole = config_from_args(build_parser().parse_args(["serve", "--no-prefix-cache"]), {})
    assert not whole.prefix_cache and defaults.prefix_cache
    fused = config_from_args(build_parser().parse_args(["serve", "--fused-kernels", "off"]), {})
    assert fused.fused_kernels == "off" and defaults.fused_kernels == "auto"
    quantized = config_from_args(build_parser().parse_args(["serve", "--quantization", "fp8"]), {})
    assert quantized.quantization == "fp8" and defaults.quantization == "none"
    vae = config_from_args(build_parser().parse_args(["serve", "--vae-fast", "fast"]), {})
    assert vae.vae_fast == "fast" and defaults.vae_fast == "exact"
    wide = config_from_args(build_parser().parse_args(["serve", "--fp8-attention", "off"]), {})
    assert wide.fp8_attention == "off" and defaults.fp8_attention == "on"
    target = config_from_args(build_parser().parse_args(["serve", "--first-audio-target-ms", "0"]), {})
    assert target.first_audio_target_ms == 0 and defaults.first_audio_target_ms == 250
    sliced = config_from_args(build_parser().parse_args(["serve", "--batch-slice-ms", "8"]), {})
    assert sliced.batch_slice_ms == 8 and defaults.batch_slice_ms == 0
    ticks = config_from_args(build_parser().parse_args(["serve", "--no-prompt-ticks"]), {})
    assert ticks.prompt_ticks is False and defaults.prompt_ticks is True
    assert ws_max_size(ServerConfig(max_client_event_bytes=1000)) > 1000


def test_exposure_options_reach_the_config() -> None:
    argv = ["serve", "--allowed-origin", "https://app.example", "--allowed-origin", "*"]
    args = build_parser().parse_args([*argv, "--metrics-host", "[::1]:9100"])
    config = config_from_args(args, {})
    assert config.allowed_origins == ["https://app.example", "*"] and config.metrics_host == "[::1]:9100"
    defaults = config_from_args(build_parser().parse_args(["serve"]), {})
    assert defaults.allowed_origins == [] and defaults.metrics_host is None


def test_duplex_kv_options_reach_the_config_and_match_the_lm() -> None:
    from omnirt.realtime.cli import DUPLEX_KV_DTYPES
    from omnirt.stages.duplex.lm import KV_DTYPES

    assert DUPLEX_KV_DTYPES == KV_DTYPES
    args = build_parser().parse_args(["serve", "--duplex-kv-dtype", "fp8", "--duplex-max-frames", "1500"])
    config = config_from_args(args, {})
    assert (config.duplex_kv_dtype, config.duplex_max_frames) == ("fp8", 1500)
    defaults = config_from_args(build_parser().parse_args(["serve"]), {})
    assert (defaults.duplex_kv_dtype, defaults.duplex_max_frames) == ("auto", None)


def test_load_format_parses_and_matches_the_loader(tmp_path: Path) -> None:
    from omnirt.realtime.cli import LOAD_FORMATS
    from omnirt.stages.speech.dummy import LOAD_FORMATS as LOADER_FORMATS

    assert LOAD_FORMATS == LOADER_FORMATS
    assert build_parser().parse_args(["serve"]).load_format == "auto"
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--load-format", "dummy"])
    assert (args.model, args.load_format) == ([str(tmp_path)], "dummy")


def test_serve_passes_the_load_format_and_reports_a_bad_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``omnirt serve --load-format dummy`` on a folder whose config.json is not Qwen3-Omni: exit 1
    with the loader's message (the load format reached the loader: auto would ask for weights)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with caplog.at_level("ERROR"):
        code = main(["serve", "--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu"])
    assert code == 1
    assert "cannot load the model" in caplog.text and "'llama' model" in caplog.text
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_omni_moe"}')
    caplog.clear()
    with caplog.at_level("ERROR"):
        assert main(["serve", "--model", str(tmp_path), "--device", "cpu"]) == 1
    assert "no *.safetensors weights" in caplog.text


def test_serve_passes_the_prefill_chunk_to_the_pipelines(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--prefill-chunk``, ``--max-context`` and ``--no-prefix-cache`` reach the pipeline builders
    (here one that then refuses the model)."""
    import omnirt.stages.factory as factory

    seen: dict = {}

    def refuse(models, **options):
        seen.update(options)
        raise ValueError("no model here")

    monkeypatch.setattr(factory, "build_pipelines", refuse)
    argv = ["serve", "--prefill-chunk", "128", "--max-context", "2048", "--no-prefix-cache"]
    argv += ["--device", "cpu"]
    assert main(argv) == 1
    assert seen["prefill_chunk"] == 128 and seen["prefix_cache"] is False and seen["max_context"] == 2048


def test_serve_passes_the_batch_slice_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--batch-slice-ms`` reaches the engine's scheduler, in seconds (here an engine that then
    refuses to start)."""
    import omnirt.stages.engine as engine
    import omnirt.stages.factory as factory

    seen: dict = {}

    def refuse(pipelines, **options):
        seen.update(options)
        raise ValueError("no engine here")

    monkeypatch.setattr(factory, "build_pipelines", lambda models, **options: [])
    monkeypatch.setattr(engine, "Engine", refuse)
    assert main(["serve", "--batch-slice-ms", "12", "--device", "cpu"]) == 1
    assert seen["batch_slice"] == pytest.approx(0.012)
    seen.clear()
    assert main(["serve", "--device", "cpu"]) == 1
    assert seen["batch_slice"] is None  # the default: the pipelines' own piece size


def _wait_healthy(base_url: str, proc: subprocess.Popen[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"omnirt serve exited with {proc.returncode}:\n{proc.stdout.read()}")  # type: ignore[union-attr]
        try:
            return httpx.get(f"{base_url}/health", timeout=2).json()
        except httpx.TransportError:
            time.sleep(0.25)
    raise AssertionError("omnirt serve did not answer /health in time")


def test_omnirt_serve_runs_the_embedded_default() -> None:
    """A real ``omnirt serve`` (embedded random-weight model on CPU) answers /health and a chat completion.

    About 7 s on the shared 2-core box with the demo checkpoint cached (about 11 s building it).
    """
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMNIRT_API_KEYS": "test-key"}
    proc = subprocess.Popen(
        [
            OMNIRT,
            "serve",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--max-sessions",
            "2",
            "--voice-alias",
            "narrator=ethan",
            "--log-level",
            "info",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        health = _wait_healthy(base_url, proc, timeout=240)
        assert health["status"] == "ok" and health["random_weights"] is True

        async def chat() -> tuple[str, str | None, int]:
            async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="test-key", max_retries=0) as client:
                model = (await client.models.list()).data[0].id
                done = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
                )
                return model, done.choices[0].finish_reason, done.usage.completion_tokens

        model, finish_reason, tokens = asyncio.run(chat())
        assert model == health["model"]
        assert finish_reason in ("stop", "length") and 1 <= tokens <= 4
        unauthorized = httpx.get(f"{base_url}/v1/models", timeout=5)
        assert unauthorized.status_code == 401
        headers = {"Authorization": "Bearer test-key"}
        card = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=5).json()["data"][0]
        # OpenAI's names onto the model's voices in turn, and the one given on the command line
        assert card["voices"] == ["chelsie", "ethan"]
        assert card["voice_aliases"]["alloy"] == "chelsie" and card["voice_aliases"]["ash"] == "ethan"
        assert card["voice_aliases"]["narrator"] == "ethan"
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out  # a clean stop on SIGTERM exits 0, not as killed by it
    assert "RANDOM weights" in out  # the log says plainly what is being served
    # The server VAD process was started with the app and ended with it (no orphan left).
    started = re.search(r"server VAD: process (\d+) ready", out)
    assert started, out
    pid = int(started.group(1))
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_a_voice_alias_onto_a_voice_the_model_lacks_stops_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``--voice-alias alloy=nobody`` on the embedded model (voices chelsie, ethan): exit 1, saying
    why, before anything listens."""
    with caplog.at_level("ERROR"):
        code = main(["serve", "--voice-alias", "alloy=nobody", "--device", "cpu", "--port", str(free_port())])
    assert code == 1
    assert "bad --voice-alias" in caplog.text and "no voice 'nobody'" in caplog.text


@pytest.mark.parametrize("value", ["-1", "60001", "0.5", "soon"])
def test_a_bad_first_audio_target_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--first-audio-target-ms", value])
    assert "expected whole milliseconds from 0 to 60000" in capsys.readouterr().err

