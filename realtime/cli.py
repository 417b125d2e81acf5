"""The ``omnirt`` command: ``omnirt serve [--model demo|PATH]... [--host H] [--port P] ...`` and
``omnirt calibrate teacache|magcache --model PATH --prompts FILE --steps 25,50`` (a diffusion step
cache's calibration: ``stages/diffusion/cache/calibrate.py``).

``serve`` builds the model pipelines (``stages.factory.build_pipelines``: one per ``--model``,
a speech checkpoint or a diffusers image/video pipeline, told apart by their folder layout), the
engine and the app, then runs uvicorn. Without ``--model`` (or with only ``--model demo``) it
serves the embedded default: the real architectures with small random weights (speech, and the
image and video pipelines), for trying the server; it says so loudly.
API keys come from ``--api-key`` (repeatable) and ``OMNIRT_API_KEYS`` (comma-separated).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ServerConfig, parse_host_port

if TYPE_CHECKING:
    from .replicas import ReplicaOptions

log = logging.getLogger("omnirt.serve")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
#: The WebSocket frame limit given to uvicorn exceeds the event limit a little, so that a frame
#: just over it reaches the realtime service and gets an ``error`` event; far larger frames are
#: closed by the transport (1009).
WS_FRAME_SLACK_BYTES = 4096
API_KEYS_ENV = "OMNIRT_API_KEYS"
#: permessage-deflate is refused on WebSockets: realtime frames are mostly base64 audio, which
#: deflate only shrinks to ~0.69, for server CPU on every append (inflate) and every audio delta
#: (deflate) and more client CPU; with it the VAD p99 at 200 sessions was 153-531 ms, not 58
#: (docs/benchmarks.md, issue 4). Clients then send plain frames, as RFC 7692 allows.
WS_PER_MESSAGE_DEFLATE = False
#: uvicorn's HTTP protocol and event loop, named: left to "auto", uvicorn takes httptools and uvloop
#: whenever they are installed (ray[serve], the ray extra, brings both), and the server would change
#: with the extras installed. h11 and asyncio are what it was built and measured on (httptools'
#: protocol objects also outlive their connections in reference cycles: tests/realtime/test_teardown.py).
UVICORN_HTTP = "h11"
UVICORN_LOOP = "asyncio"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: ``--step-cache`` choices (``stages.diffusion.cache.config.BACKENDS``; a test checks they agree).
STEP_CACHES = ("none", "teacache", "magcache")
#: ``--load-format`` choices (``stages.speech.dummy.LOAD_FORMATS``, repeated here so that parsing
#: arguments imports no torch; a test checks that the two agree).
LOAD_FORMATS = ("auto", "dummy")
#: ``--duplex-kv-dtype`` choices (``stages.duplex.lm.KV_DTYPES``; a test checks they agree).
DUPLEX_KV_DTYPES = ("auto", "fp8")


def ws_max_size(config: ServerConfig) -> int:
    return config.max_client_event_bytes + WS_FRAME_SLACK_BYTES


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 1 and 65535, not {port}")
    return port


def _host(text: str) -> str:
    """An address to listen on; empty is refused (uvicorn would listen on every interface)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected an address such as 127.0.0.1 or 0.0.0.0, not an empty one")
    return text.strip()


def _integer_from(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    return parse


_positive = _integer_from(1)
_nonnegative = _integer_from(0)


def _voice_alias(text: str) -> tuple[str, str]:
    name, sep, voice = text.partition("=")
    if not sep or not name.strip() or not voice.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VOICE (e.g. alloy=Ethan), not {text!r}")
    return name.strip(), voice.strip()


def _device(text: str) -> str:
    if text == "cpu" or re.fullmatch(r"cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"device must be cpu, cuda or cuda:N, not {text!r}")


def _milliseconds(most: int) -> Callable[[str], int]:
    """An argparse type: whole milliseconds from 0 to ``most``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if not 0 <= value <= most:
            raise argparse.ArgumentTypeError(f"expected whole milliseconds from 0 to {most}, not {text!r}")
        return value

    return parse


def _prefill_chunk(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 16:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, at least 16, not {text!r}")
    return value


def _origin(text: str) -> str:
    from .origin import ANY_ORIGIN, normalize_origin

    if text == ANY_ORIGIN or normalize_origin(text) is not None:
        return text
    raise argparse.ArgumentTypeError(
        f"expected an origin such as https://app.example.com (or *), not {text!r}"
    )


def _host_port(text: str) -> str:
    try:
        parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _model(text: str) -> str:
    if text == "demo" or Path(text).expanduser().exists():
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither 'demo' nor an existing local path (nothing is downloaded)"
    )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, not {text!r}")
    return value


def _file(text: str) -> str:
    if Path(text).expanduser().is_file():
        return text
    raise argparse.ArgumentTypeError(f"no such file: {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnirt", description="Serving engine for realtime voice AI.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the server",
        description="Serve /v1/realtime, /v1/chat/completions, /v1/images/generations, /v1/videos, "
        "/v1/models, /health and /metrics.",
    )
    serve.add_argument(
        "--model",
        type=_model,
        action="append",
        default=[],
        metavar="PATH",
        help="a local model folder: a speech checkpoint (config.json of Qwen3-Omni) or a diffusers image "
        "or video pipeline (model_index.json); repeatable, at most one speech model. 'demo': the embedded "
        "speech model. None given: the embedded default (speech, image and video, RANDOM weights)",
    )
    serve.add_argument(
        "--duplex-model",
        default=None,
        metavar="PATH",
        help="a local Moshi-architecture checkpoint served to full-duplex sessions (/v1/realtime?duplex=1); "
        "'demo': the embedded tiny one (RANDOM weights), which the embedded default serves too; 'none': "
        "no duplex model (duplex=1 is refused with 'unsupported')",
    )
    serve.add_argument(
        "--duplex-kv-dtype",
        choices=DUPLEX_KV_DTYPES,
        default=ServerConfig.duplex_kv_dtype,
        help="the duplex LM's attention cache: auto (the model's dtype, bf16 on CUDA: exact) or fp8 "
        "(e4m3 with a scale per stored vector: half the memory, so twice the sessions at a given "
        "conversation length; see docs/duplex.md)",
    )
    serve.add_argument(
        "--duplex-max-frames",
        type=_positive,
        default=None,
        metavar="N",
        help="the duplex LM's attention window and longest conversation, in 80 ms frames (default: the "
        "model's, 3000 = 4 minutes for Moshi 7B); the cache of every slot holds this many frames",
    )
    serve.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="auto (the default): read the checkpoints' weights; dummy: build each model from its config "
        "alone (config.json, model_index.json and component configs) with seeded RANDOM weights on the "
        "device (real size, for benchmarks; tokenizer and preprocessor from the folder when it has them, "
        "else the embedded default's)",
    )
    serve.add_argument(
        "--host", type=_host, default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000)")
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"accept this API key (repeatable; also ${API_KEYS_ENV}, comma-separated). No keys: no auth",
    )
    serve.add_argument(
        "--allowed-origin",
        type=_origin,
        action="append",
        default=[],
        metavar="ORIGIN",
        help="also accept browser requests (realtime WebSocket, POST/DELETE) from this web origin, e.g. "
        "https://app.example.com (repeatable; * for any). By default only the server's own origin (the "
        "Host the request was sent to); requests without an Origin header (SDKs, curl) always pass",
    )
    serve.add_argument(
        "--metrics-host",
        type=_host_port,
        default=None,
        metavar="HOST:PORT",
        help="serve /metrics on this separate address instead of the API port, without a key (bind it to "
        "a private address). By default /metrics is on the API port, behind the API key when keys are set",
    )
    serve.add_argument(
        "--max-sessions",
        type=_positive,
        default=ServerConfig.max_sessions,
        help=f"concurrent realtime sessions; also the engine's slots (default {ServerConfig.max_sessions})",
    )
    serve.add_argument(
        "--voice-alias",
        action="append",
        type=_voice_alias,
        default=[],
        metavar="NAME=VOICE",
        help="accept voice NAME in realtime sessions as the model's voice VOICE (repeatable). By default "
        "OpenAI's names (alloy, ash, ballad, coral, echo, sage, shimmer, verse, marin, cedar) map onto the "
        "model's voices in turn; this overrides or adds names",
    )
    serve.add_argument(
        "--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda when available)"
    )
    serve.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run the models' steps eagerly on CUDA instead of replaying captured CUDA graphs (the speech "
        "decode, the codecs, and the diffusion transformers' block pieces where those are graphed)",
    )
    serve.add_argument(
        "--prefill-chunk",
        type=_prefill_chunk,
        default=ServerConfig.prefill_chunk,
        metavar="TOKENS",
        help="prompt tokens a speech prompt pass reads per engine tick (default %(default)s): a longer "
        "prompt is read over several ticks, so it never stalls the sessions already speaking",
    )
    serve.add_argument(
        "--max-context",
        type=_integer_from(64),
        default=ServerConfig.max_context,
        metavar="TOKENS",
        help="tokens of context each speech session holds (default: the longest power of two up to the "
        "model's limit whose slots fit the GPU's memory; 4096 on CPU). A realtime conversation longer "
        "than that leaves its oldest messages out (session.truncation)",
    )
    serve.add_argument(
        "--first-audio-target-ms",
        type=_milliseconds(60_000),
        default=ServerConfig.first_audio_target_ms,
        metavar="MS",
        help="while image or video jobs wait, a spoken reply's first audio is due this long after the "
        "speech pipeline takes it (default %(default)s); diffusion steps run in the slack, and speech "
        "that is playing always keeps ahead of its playback. 0: first audio before any diffusion step",
    )
    serve.add_argument(
        "--prompt-ticks",
        action=argparse.BooleanOptionalAction,
        default=ServerConfig.prompt_ticks,
        help="read a new turn's prompt in a speech tick of its own while other replies make frames "
        "(their frame step is not lengthened by it; default: on); --no-prompt-ticks: in the frame "
        "ticks (docs/benchmarks.md, issue 10)",
    )
    serve.add_argument(
        "--batch-slice-ms",
        type=_milliseconds(10_000),
        default=ServerConfig.batch_slice_ms,
        metavar="MS",
        help="while speech is active, image and video work runs in pieces of at most this long, fitted "
        "between the speech steps: a turn that starts waits at most one piece (default %(default)s: the "
        "pipelines' own piece size, 50 ms; 20 and 10 ms measured no better on an H200)",
    )
    serve.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="read every speech prompt whole, instead of reusing the cached prefix that an earlier "
        "request of the same conversation (or over the same context) has read",
    )
    serve.add_argument(
        "--fused-kernels",
        choices=("auto", "on", "off"),
        default=ServerConfig.fused_kernels,
        help="the fused Triton kernels (QK norm + RoPE, AdaLN) on CUDA: auto (the default) where they "
        "are bitwise equal to eager, on wherever supported, off",
    )
    serve.add_argument(
        "--vae-fast",
        choices=("exact", "fast", "off"),
        default=ServerConfig.vae_fast,
        help="the Wan VAE decoder's fused Triton kernels on CUDA: exact (the default, bitwise equal "
        "to diffusers), fast (the top level's 96-channel convolutions as 2D ones over their stacked "
        "time taps, bias and residual in cuDNN's epilogue: not bitwise, 55 dB against diffusers; "
        "docs/kernels.md), off",
    )
    serve.add_argument(
        "--fp8-attention",
        choices=("on", "off"),
        default=ServerConfig.fp8_attention,
        help="with --quantization fp8, the DiT blocks' attention in fp8 too (cuDNN's fp8 flash attention "
        "on Hopper and later: queries, keys, values and probabilities in e4m3; not bitwise; "
        "default %(default)s)",
    )
    serve.add_argument(
        "--quantization",
        choices=("none", "int8", "fp8"),
        default=ServerConfig.quantization,
        help="the diffusion transformers' linear layers as W8A8: int8, fp8 (Hopper), or none (the "
        "default); quantized at load, layer by layer; /v1/models reports it per model",
    )
    serve.add_argument(
        "--step-cache",
        choices=STEP_CACHES,
        default="none",
        help="the diffusion step cache of requests that name none (their cache_backend): none (the "
        "default), teacache or magcache; every image/video model must have a calibration for it",
    )
    serve.add_argument(
        "--step-cache-config",
        type=_json_object,
        default={},
        metavar="JSON",
        help="the default step cache's settings, e.g. '{\"threshold\": 0.1}' (docs/http.md); left out: "
        "the calibrated defaults",
    )
    serve.add_argument(
        "--step-cache-calibration",
        type=_file,
        action="append",
        default=[],
        metavar="FILE",
        help="a step-cache calibration file (omnirt calibrate) (repeatable); also read: "
        "<model folder>/omnirt-calibration/*.json and those shipped for the embedded models",
    )
    serve.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="default info")
    _add_replicas(serve)
    _add_calibrate(commands)
    return parser


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be at least 0 and finite, not {text}")
    return value


def _add_replicas(serve: argparse.ArgumentParser) -> None:
    """Replicas on Ray Serve (realtime/replicas/, the ``ray`` extra; docs/replicas.md)."""
    group = serve.add_argument_group(
        "replicas (Ray Serve; pip install 'omnirt[ray]')",
        "Run several omnirt servers (one per GPU with --device cuda, else one per CPU slot) behind Ray "
        "Serve's HTTP proxy on --host/--port, realtime sessions routed to the replica with the most "
        "free session slots; every other option applies to each replica.",
    )
    group.add_argument(
        "--replicas",
        type=_positive,
        default=None,
        metavar="N",
        help="run N replicas (with --min/--max-replicas: N to start with)",
    )
    group.add_argument(
        "--min-replicas",
        type=_nonnegative,
        default=None,
        metavar="N",
        help="autoscale (Ray Serve's autoscaler, on ongoing sessions and requests) down to N replicas",
    )
    group.add_argument(
        "--max-replicas", type=_positive, default=None, metavar="N", help="autoscale up to N replicas"
    )
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="join this Ray cluster (e.g. 10.0.0.1:6379 of 'ray start --head'); default: RAY_ADDRESS, else "
        "a cluster that 'ray start' began on this machine, else Ray started here (ray.init's rules)",
    )
    group.add_argument(
        "--replica-cpus",
        type=_nonnegative_float,
        default=1.0,
        metavar="N",
        help="CPU slots each replica takes (default 1)",
    )
    group.add_argument(
        "--drain-seconds",
        type=_nonnegative_float,
        default=30.0,
        metavar="S",
        help="a replica being removed admits no new sessions and lets live ones go on this long, then "
        "closes them with 1001 (default 30)",
    )
    group.add_argument(
        "--ingress",
        choices=("proxy", "haproxy"),
        default="proxy",
        help="proxy (default): Ray Serve's HTTP proxy, omnirt's request router; haproxy: Ray Serve's "
        "HAProxy in front of replicas that serve HTTP themselves (about 0.02 ms per event instead of "
        "about 0.8), omnirt's routing done in the replicas (docs/replicas.md)",
    )


def replicas_wanted(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.replicas, args.min_replicas, args.max_replicas, args.ray_address))


def replica_options(args: argparse.Namespace) -> ReplicaOptions:
    from .replicas import ReplicaOptions

    return ReplicaOptions(
        replicas=args.replicas if args.replicas is not None else max(1, args.min_replicas or 0),
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        ray_address=args.ray_address,
        cpus_per_replica=args.replica_cpus,
        drain_seconds=args.drain_seconds,
        ingress=args.ingress,
    )


def _add_calibrate(commands: Any) -> None:
    """``omnirt calibrate`` (stages/diffusion/cache/calibrate.py runs it)."""
    p = commands.add_parser(
        "calibrate",
        help="calibrate a diffusion step cache (teacache, magcache) for a model",
        description="Run full-compute trajectories of the prompts through the serving runtime, fit the "
        "step cache's model (TeaCache's polynomial, MagCache's ratios), print the fit and write the "
        "calibration file the server reads.",
    )
    p.add_argument("backend", choices=STEP_CACHES[1:])
    p.add_argument(
        "--model",
        required=True,
        help="a diffusers image or video folder, or demo-z-image / demo-wan2.1-t2v (the embedded models)",
    )
    p.add_argument("--prompts", required=True, type=Path, help="a text file, one prompt a line")
    p.add_argument(
        "--steps", default="25,50", help="step counts to calibrate, comma-separated (default 25,50)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the file to write (default <model>/omnirt-calibration/<backend>.json)",
    )
    p.add_argument("--size", default=None, help="WxH (default: the model's)")
    p.add_argument("--frames", type=int, default=None, help="video frames (default: the model's)")
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the model's")
    p.add_argument(
        "--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda when available)"
    )
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto")
    p.add_argument(
        "--target-speedup",
        type=float,
        default=1.5,
        help="TeaCache's default threshold aims at it (default 1.5)",
    )
    p.add_argument("--threshold", type=float, default=None, help="write this default threshold instead")
    p.add_argument("--max-skip-steps", type=int, default=3, help="MagCache's default (3)")
    p.add_argument("--retention-ratio", type=float, default=0.2, help="MagCache's default (0.2)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="default info")


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerConfig:
    keys = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    keys += [k.strip() for k in args.api_key if k.strip()]
    return ServerConfig(
        host=args.host,
        port=args.port,
        models=list(args.model),
        duplex_model=args.duplex_model,
        duplex_kv_dtype=args.duplex_kv_dtype,
        duplex_max_frames=args.duplex_max_frames,
        api_keys=list(dict.fromkeys(keys)),
        max_sessions=args.max_sessions,
        cuda_graphs=not args.no_cuda_graphs,
        prefill_chunk=args.prefill_chunk,
        max_context=args.max_context,
        prefix_cache=not args.no_prefix_cache,
        first_audio_target_ms=args.first_audio_target_ms,
        prompt_ticks=args.prompt_ticks,
        batch_slice_ms=args.batch_slice_ms,
        fused_kernels=args.fused_kernels,
        vae_fast=args.vae_fast,
        fp8_attention=args.fp8_attention,
        quantization=args.quantization,
        voice_aliases=dict(args.voice_alias),
        allowed_origins=list(args.allowed_origin),
        metrics_host=args.metrics_host,
        step_cache=args.step_cache,
        step_cache_config=dict(args.step_cache_config),
        step_cache_calibrations=list(args.step_cache_calibration),
    )


def serve(config: ServerConfig, *, device: str | None, log_level: str, load_format: str = "auto") -> int:
    # Heavy imports (torch, the model code) only once a server is really wanted.
    import uvicorn

    from .build import BuildError, build_app
    from .graceful import GracefulServer
    from .ws_protocol import websocket_protocol

    try:
        app = build_app(config, device=device, load_format=load_format)
    except BuildError as exc:
        log.error("%s", exc)
        return 1
    info = app.state.client.info
    log.info(
        "serving %s (%s, from %s) on http://%s:%d; auth %s; up to %d realtime sessions",
        info.id,
        info.architecture,
        info.source,
        config.host,
        config.port,
        f"on ({len(config.api_keys)} keys)" if config.api_keys else "off",
        config.max_sessions,
    )
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=log_level,
            http=UVICORN_HTTP,
            loop=UVICORN_LOOP,
            ws=websocket_protocol(config.ws_send_buffer_bytes),
            ws_max_size=ws_max_size(config),
            ws_per_message_deflate=WS_PER_MESSAGE_DEFLATE,
            lifespan="on",
        ),
        app,
    )
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly
        log.info("stopped")
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    if args.command == "calibrate":
        from omnirt.stages.diffusion.cache.calibrate import run

        return run(args)
    config = config_from_args(args, os.environ)
    if replicas_wanted(args):
        from .replicas import serve_replicas
        from .replicas.launch import check_config

        options = replica_options(args)
        try:
            options.validate()
            check_config(config, args.device)
        except ValueError as exc:
            parser.error(str(exc))
        return serve_replicas(
            config, options, device=args.device, load_format=args.load_format, log_level=args.log_level
        )
    return serve(config, device=args.device, log_level=args.log_level, load_format=args.load_format)


if __name__ == "__main__":
    sys.exit(main())
