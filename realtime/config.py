"""Server configuration: everything a deployment sets, with its limits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    #: ``--model``, each a local folder (a speech checkpoint or a diffusers pipeline) or
    #: ``"demo"`` (the embedded speech model). Empty: the embedded default models.
    models: list[str] = field(default_factory=list)
    #: ``--duplex-model``: a local Moshi-architecture checkpoint served to ``?duplex=1`` sessions;
    #: ``"demo"``: the embedded tiny one (random weights), which the embedded default serves too;
    #: ``"none"``: no duplex model (``duplex=1`` is refused). ``None``: the embedded one when no
    #: ``--model`` is given, else none.
    duplex_model: str | None = None
    #: ``--duplex-kv-dtype``: the duplex LM's attention cache, ``auto`` (the model's dtype) or
    #: ``fp8`` (half the memory); ``--duplex-max-frames``: its window and longest conversation in
    #: 80 ms frames (None: the model's). Sessions that fit: docs/duplex.md.
    duplex_kv_dtype: str = "auto"
    duplex_max_frames: int | None = None
    #: Duplex sessions: input the client may send ahead of what the model has consumed (beyond:
    #: ``input_backpressure``), and the stretch rule (``sessions/stretches.py``): frames at or
    #: below ``duplex_quiet_dbfs`` with padding text are quiet, ``duplex_quiet_frames`` of them
    #: in a row end a stretch of model speech (one response).
    duplex_max_ahead_ms: int = 2_000
    duplex_quiet_dbfs: float = -40.0
    duplex_quiet_frames: int = 6
    #: Replay the model's steps from captured CUDA graphs on CUDA (``--no-cuda-graphs``: eager).
    cuda_graphs: bool = True
    #: Prompt tokens a speech prompt pass reads per engine tick; a longer prompt is read over
    #: several ticks beside the running sessions (``--prefill-chunk``).
    prefill_chunk: int = 512
    #: Tokens of context each speech session's slot holds (``--max-context``; None: the longest
    #: power of two up to the model's limit whose slots fit the memory, at most 4096 on CPU).
    #: A realtime conversation over it is truncated (``session.truncation``).
    max_context: int | None = None
    #: Keep each slot's prompt and reply for later requests that start the same way (the next
    #: turn of a conversation, out-of-band responses over one context): only the rest of their
    #: prompt is read (``--no-prefix-cache``: every prompt read whole).
    prefix_cache: bool = True
    #: While image or video work waits, a spoken reply's first audio is due this many
    #: milliseconds after the speech pipeline takes it; diffusion steps run in the slack
    #: (``--first-audio-target-ms``; 0: first audio before any diffusion step).
    first_audio_target_ms: int = 250
    #: Inline prompt passes in speech ticks of their own while other replies make frames, so a
    #: new turn never lengthens their frame step (``--no-prompt-ticks``: prompts are read in the
    #: frame ticks). Measured on an H200 beside diffusion (docs/benchmarks.md, issue 10): the
    #: frame p99 within 10% of speech alone, and no audio delta late.
    prompt_ticks: bool = True
    #: While realtime work is active, an image or video step is a piece of at most this many
    #: milliseconds (or one part that cannot split); 0: the pipeline's own size (50 ms). Pieces
    #: are fitted to the time before the next realtime deadline either way; this bounds what a
    #: turn that starts without warning waits behind (``--batch-slice-ms``).
    batch_slice_ms: int = 0
    #: The fused Triton kernels of ``kernels/`` (QK norm + RoPE, AdaLN) on CUDA: ``auto`` where
    #: their exact preset is bitwise equal to eager, ``on`` wherever supported, ``off``
    #: (``--fused-kernels``).
    fused_kernels: str = "auto"
    #: The Wan VAE decoder's fast path on CUDA: ``exact`` (bitwise diffusers'), ``fast`` (some
    #: convolutions reordered: not bitwise, within a stated PSNR) or ``off`` (``--vae-fast``).
    vae_fast: str = "exact"
    #: The fp8 W8A8 DiT blocks' attention in fp8 as well (cuDNN's fp8 flash attention, where it
    #: applies): ``on`` or ``off`` (``--fp8-attention``).
    fp8_attention: str = "on"
    #: W8A8 linear layers for the diffusion transformers: ``none``, ``int8`` or ``fp8``
    #: (``--quantization``; reported per model in ``/v1/models``).
    quantization: str = "none"
    #: The diffusion step cache a request gets when it names none (``--step-cache``: none,
    #: teacache, magcache), its settings (``--step-cache-config``, a JSON object) and calibration
    #: files beyond the shipped ones and the model folders' (``--step-cache-calibration``).
    step_cache: str = "none"
    step_cache_config: dict = field(default_factory=dict)
    step_cache_calibrations: list[str] = field(default_factory=list)
    #: Empty: no authentication. Otherwise a request must present one of these keys.
    api_keys: list[str] = field(default_factory=list)
    #: Web origins (``scheme://host[:port]``) allowed besides the server's own to open realtime
    #: sessions and send POST/DELETE requests from a browser; ``"*"``: any. ``--allowed-origin``.
    allowed_origins: list[str] = field(default_factory=list)
    #: ``HOST:PORT`` of a separate listener for ``/metrics`` (then not served on the API port,
    #: and open there: bind it to a private address). ``None``: ``/metrics`` on the API port,
    #: behind the API key when keys are set. ``--metrics-host``.
    metrics_host: str | None = None
    #: OpenAI voice names (or any others) as aliases of the model's voices, alias -> model voice,
    #: on top of the default mapping (OpenAI's ten names onto the model's voices by index;
    #: ``omnirt.sessions.voices``). ``--voice-alias NAME=VOICE``.
    voice_aliases: dict[str, str] = field(default_factory=dict)
    #: Concurrent realtime sessions; the next one gets ``resource_exhausted``.
    max_sessions: int = 32
    #: Wall-clock lifetime of one realtime session (``session_expired``, close 1001).
    max_session_seconds: float = 30 * 60
    #: Largest client text frame accepted on the WebSocket (bytes).
    max_client_event_bytes: int = 16 * 1024 * 1024
    #: Largest decoded ``input_audio_buffer.append`` payload (bytes).
    max_append_bytes: int = 15 * 1024 * 1024
    #: Audio held in the input buffer before ``input_backpressure`` (bytes of 24 kHz PCM16).
    max_input_buffer_bytes: int = 24_000 * 2 * 120
    #: Reply length cap when a client asks for ``inf`` (thinker tokens).
    max_output_tokens: int = 512
    #: Request body limit for the HTTP endpoints (bytes).
    max_http_body_bytes: int = 32 * 1024 * 1024
    #: A realtime connection with no client frame for this long is closed
    #: (``session_idle_timeout``, close 1001). ``None``: never.
    max_idle_seconds: float | None = 10 * 60
    #: Images in a realtime session's model context, and the largest one (decoded bytes); over
    #: either: ``image_limit_exceeded``, except that with truncation on a new image leaves the
    #: oldest messages (up to the oldest image) out of the context instead.
    max_images_per_session: int = 16
    max_image_bytes: int = 10 * 1024 * 1024
    #: Out-of-band responses (``conversation: "none"``) one realtime session may run at once;
    #: the next gets ``resource_exhausted``. Each takes a model slot while it runs (held ones
    #: too), so one session takes at most this many plus its in-band response.
    max_out_of_band_responses: int = 2
    #: Server VAD: Silero ONNX file (``None``: the one bundled with the silero-vad wheel).
    vad_model_path: str | None = None
    #: Server VAD: audio a session may have waiting for the VAD before ``input_backpressure``.
    max_vad_backlog_ms: int = 5_000
    #: Server VAD: most windows scored in one model call, and the shortest interval between the
    #: VAD process's scoring passes (chunks arriving within it share the model calls: latency
    #: traded for CPU).
    vad_max_batch: int = 256
    vad_gather_ms: float = 3.0
    #: Server VAD: niceness change for the VAD process (negative: higher priority, so its short
    #: passes are not delayed behind the event loop on a busy machine; needs CAP_SYS_NICE or
    #: root, else it runs at the default priority with a warning). 0: leave it.
    vad_nice: int = 0
    #: Server VAD: start the VAD process when the app starts, in a thread (else the first
    #: session, which starts with server VAD, starts it, blocking the event loop for about half a
    #: second).
    vad_preload: bool = True
    #: Images and videos: the most images one request may ask for (``n``), the largest side of a
    #: size, and the most denoising steps (each model may allow fewer: its pipeline says).
    max_images_per_request: int = 4
    max_media_side: int = 4096
    max_inference_steps: int = 200
    #: Videos: the longest clip (seconds) and the most frames and fps a request may ask for.
    max_video_seconds: float = 60.0
    max_video_frames: int = 2048
    max_video_fps: int = 120
    #: Video jobs kept in memory: at most this many, their MP4s at most this many bytes together
    #: (the oldest finished jobs go first), and a finished job at most this long.
    max_video_jobs: int = 64
    max_video_store_bytes: int = 1 << 30
    video_job_ttl_seconds: float = 3600.0
    #: Server events queued for one realtime connection and not yet taken by its socket (bytes of
    #: JSON). A client that reads more slowly than the session produces (or not at all) and falls
    #: this far behind has its responses cancelled and is closed with 1008 (``docs/realtime.md``).
    #: 8 MiB: about two minutes of base64 24 kHz audio deltas.
    max_send_queue_bytes: int = 8 * 1024 * 1024
    #: Past this many queued bytes the connection's responses are held (they take no model steps)
    #: until the client has read the queue down to half of it: a client that reads slowly gets
    #: no compute ahead of its reading. 256 KiB: about 4 s of audio deltas.
    hold_send_queue_bytes: int = 256 * 1024
    #: A client held this long without reading its queue down is closed with 1008, as one past
    #: ``max_send_queue_bytes`` is.
    max_held_seconds: float = 30.0
    #: Past this many bytes in the connection's kernel send queue not yet taken by the client
    #: (``SIOCOUTQ``; Linux) its responses are held too. On a working connection the client's
    #: TCP stack takes bytes as they come (its receive window stays open); bytes piling up in
    #: the send queue mean its application stopped reading and its receive buffer filled. This
    #: sees such a client after its receive buffer plus 64 KiB (about 2 s of audio deltas),
    #: instead of after every buffer on the way and ``hold_send_queue_bytes``. 0: off.
    hold_socket_bytes: int = 64 * 1024
    #: Kernel send buffer (SO_SNDBUF) of each realtime WebSocket connection (``realtime.ws_protocol``);
    #: 0: the kernel's automatic sizing (which grows to megabytes even for a client that never reads).
    ws_send_buffer_bytes: int = 128 * 1024
    #: Realtime conversation caps: items held, and bytes held (text, audio, images); over
    #: either, ``conversation.item.create`` and commits get ``conversation_limit_exceeded``, except
    #: that with truncation on the oldest items' audio and images are dropped to keep the bytes cap
    #: (those items left out of the model's context; their text stays).
    max_conversation_items: int = 1000
    max_conversation_bytes: int = 64 * 1024 * 1024
    #: On shutdown (SIGTERM), how long realtime connections get to end their streaming responses
    #: with ``response.done`` and close with 1012 before the server closes them anyway.
    shutdown_grace_seconds: float = 5.0
    #: Long generations log their progress at most this often (seconds).
    progress_log_seconds: float = 10.0


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6) -> (host, port); ValueError when it is not one."""
    host, sep, port_text = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9100), not {text!r}")
    return host, int(port_text)
