"""The speech pipeline on CUDA: fp32 parity with ``generate`` on the GPU (decode steps replayed
from CUDA graphs), graph replay == eager bitwise for every captured decode step, no host sync
inside the steps, bf16 end to end, the streaming vocoder on CUDA graphs, and the latency of a
1 s audio turn (printed; run with ``pytest -m gpu -s tests/speech``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omnirt.codecs.audio import float_to_int16
from omnirt.stages.graphs import CudaGraphRunner
from omnirt.stages.speech.code2wav import StreamingVocoder, make_vocoder
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.types import (
    AudioDelta,
    AudioPart,
    ContextMessage,
    Finished,
    GenerationRequest,
    TextDelta,
    TextPart,
)

from .conftest import TokenLog, audio_request, drain, of, tone

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_fp32_reply_equals_generate(demo_dir: Path, no_tf32, graphs: bool) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(demo_dir)).eval().cuda()
    pipe = load_speech_pipeline(demo_dir, device="cuda", dtype=torch.float32, max_slots=4, cuda_graphs=graphs)
    req = audio_request("r", tone(1.0), max_output_tokens=24)
    prompt = pipe.prompts.build(req.messages)
    ids = prompt.input_ids.cuda()
    extra = {k: v.cuda() for k, v in prompt.model_kwargs().items()}
    common = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        thinker_max_new_tokens=24,
        thinker_do_sample=False,
        **extra,
    )
    greedy = hf.generate(return_audio=False, thinker_eos_token_id=hf.config.im_end_token_id, **common)
    greedy = greedy[0, ids.shape[1] :].tolist()
    eos = greedy[next(i for i, t in enumerate(greedy) if i >= 4 and t not in greedy[:i])]
    seq, wav = hf.generate(
        return_audio=True,
        thinker_eos_token_id=eos,
        talker_max_new_tokens=40,
        talker_do_sample=False,
        **common,
    )
    pipe.stop_token_ids = {eos}
    pipe.max_audio_frames = 39
    log = TokenLog(pipe)
    frames: list[torch.Tensor] = []
    push = pipe.vocoder.push
    pipe.vocoder.push = lambda key, frame: (frames.append(frame.clone()), push(key, frame))[1]
    pipe.add(req)
    outs = of(drain(pipe), "r")
    assert log.tokens["r"] == seq[0, ids.shape[1] :].tolist()
    pcm = np.concatenate([o.pcm for o in outs if isinstance(o, AudioDelta)])
    expected = wav.reshape(-1).float().cpu().numpy()
    assert pcm.shape == expected.shape
    off = np.flatnonzero(np.abs(pcm / 32768.0 - expected) > 2e-4)
    first_frame = (off[0] + 555) // 1920 if off.size else None
    print(f"\n[gpu] fp32 graphs={graphs}: {len(frames)} frames; first off generate's audio: {first_frame}")
    np.testing.assert_allclose(pcm / 32768.0, expected, atol=2e-4, rtol=0)


def test_cuda_vocoder_replays_graphs_bitwise(demo_dir: Path) -> None:
    """The pipeline's streaming vocoder captures its steps (2 and 6 frames) at load and replays
    them; the audio of a turn equals an eager vocoder's (``graphs=False``) given the same pushes
    and pulls, bitwise."""
    pipe = load_speech_pipeline(
        demo_dir, device="cuda", dtype=torch.bfloat16, max_slots=4, max_audio_frames=30
    )
    vocoder = pipe.vocoder
    assert isinstance(vocoder, StreamingVocoder)
    runners = vocoder.streamer.runners
    assert sorted(runners) == [2, 6]
    assert all(isinstance(r, CudaGraphRunner) and r.captured_buckets == [1, 2, 4] for r in runners.values())
    calls: list[tuple[str, object]] = []  # ("push", frame) and ("pull", finishing), in order
    pulled: list[np.ndarray] = []
    paths: set[str] = set()
    push, pull = vocoder.push, vocoder.pull

    def record_push(key: str, frame: torch.Tensor) -> None:
        calls.append(("push", frame.clone()))
        push(key, frame)

    def record_pull(finishing):
        calls.append(("pull", set(finishing)))
        for r in runners.values():
            r.last_path = ""  # stays empty on ticks that decode nothing
        out = pull(finishing)
        paths.update(r.last_path for r in runners.values())
        pulled.extend(pcm for pcm, _ in out.values())
        return out

    vocoder.push, vocoder.pull = record_push, record_pull  # type: ignore[method-assign]
    pipe.add(audio_request("r", tone(1.0), max_output_tokens=12))
    outs = of(drain(pipe), "r")
    assert isinstance(outs[-1], Finished) and outs[-1].reason != "error"
    frames = sum(kind == "push" for kind, _ in calls)
    assert frames > 8 and paths - {""} == {"graph"}
    assert vocoder.streamer.free_slots == 4

    eager = make_vocoder(pipe.model.code2wav, "stream", max_streams=4, graphs=False)
    assert eager.streamer.runners == {}  # type: ignore[attr-defined]
    eager.open("r")
    expected_parts = []
    for kind, value in calls:
        if kind == "push":
            eager.push("r", value)
        else:
            expected_parts.extend(pcm for pcm, _ in eager.pull(value).values())
    expected = np.concatenate(expected_parts)
    got = np.concatenate(pulled)
    assert got.shape == expected.shape == (frames * 1920 - 555,)
    assert np.array_equal(got, expected)
    sent = np.concatenate([o.pcm for o in outs if isinstance(o, AudioDelta)])
    assert np.array_equal(sent, float_to_int16(expected))
    print(
        f"\n[gpu] speech pipeline bf16: vocoder replayed its CUDA graphs (buckets 1, 2, 4; 2 and 6 frames) "
        f"for {frames} frames; PCM == graphs=False vocoder bitwise"
    )


def test_cuda_bf16_turn_latency(demo_dir: Path) -> None:
    pipe = load_speech_pipeline(
        demo_dir, device="cuda", dtype=torch.bfloat16, max_slots=32, warm_up=True, max_audio_frames=60
    )
    firsts = []
    for i in range(3):
        t0 = time.perf_counter()
        pipe.add(audio_request(f"r{i}", tone(1.0), max_output_tokens=30))
        first = None
        outs = []
        while pipe.has_work():
            step = pipe.step()
            outs += step
            if first is None and any(isinstance(o, AudioDelta) for _, o in step):
                first = time.perf_counter() - t0
        assert any(isinstance(o, TextDelta) for _, o in outs) and first is not None
        firsts.append(first)
    for n in (8, 32):
        for i in range(n):
            pipe.add(audio_request(f"c{n}-{i}", tone(1.0, 200.0 + i), max_output_tokens=30))
        t0 = time.perf_counter()
        outs = drain(pipe)
        seconds = time.perf_counter() - t0
        audio = sum(o.pcm.size for _, o in outs if isinstance(o, AudioDelta)) / 24_000
        steps = max(o.usage.output_audio_tokens for _, o in outs if isinstance(o, Finished))
        print(
            f"\n{n} concurrent 1 s audio turns: {seconds:.2f} s wall for {audio:.1f} s of audio, "
            f"{seconds / steps * 1000:.1f} ms per talker frame"
        )
    print(f"\nbf16 CUDA, 1 s audio turn, time to first audio: {[round(f * 1000) for f in firsts]} ms")


def test_cuda_sampled_turns_are_seeded_and_complete(demo_dir: Path) -> None:
    """Sampling on CUDA (chat completions default to temperature 1.0): the request's generator
    lives on the model's device, the turn completes with text and audio, and a seed repeats it."""
    pipe = load_speech_pipeline(
        demo_dir, device="cuda", dtype=torch.bfloat16, max_slots=4, max_audio_frames=20
    )
    log = TokenLog(pipe)

    def turn(rid: str, seed: int) -> tuple[list[int], np.ndarray]:
        pipe.add(audio_request(rid, tone(1.0), max_output_tokens=12, temperature=1.0, top_p=0.9, seed=seed))
        outs = of(drain(pipe), rid)
        assert isinstance(outs[-1], Finished) and outs[-1].reason in ("stop", "length"), outs[-1]
        assert any(isinstance(o, TextDelta) for o in outs)
        pcm = np.concatenate([o.pcm for o in outs if isinstance(o, AudioDelta)])
        return log.tokens[rid], pcm

    tokens_a, pcm_a = turn("a", seed=7)
    tokens_b, pcm_b = turn("b", seed=7)
    tokens_c, _ = turn("c", seed=8)
    assert tokens_a == tokens_b and np.array_equal(pcm_a, pcm_b) and len(pcm_a) > 0
    print(
        f"\n[gpu] sampled bf16 turns: seed 7 twice identical ({len(tokens_a)} tokens, "
        f"{len(pcm_a)} samples); seed 8 {'differs' if tokens_c != tokens_a else 'same tokens'}"
    )


def _turns(pipe, requests) -> tuple[dict[str, list[int]], dict[str, np.ndarray], set[str]]:
    """Runs ``requests`` at once; returns each one's tokens and PCM, and the decode paths taken."""
    log = TokenLog(pipe)
    paths: set[str] = set()
    for req in requests:
        pipe.add(req)
    outs = []
    while pipe.has_work():
        for runner in pipe.runners:
            runner.last_path = ""
        outs += pipe.step()
        paths |= {r.last_path for r in pipe.runners} - {""}
    pcm = {}
    for req in requests:
        mine = of(outs, req.request_id)
        assert isinstance(mine[-1], Finished) and mine[-1].reason in ("stop", "length"), mine[-1]
        pcm[req.request_id] = np.concatenate([o.pcm for o in mine if isinstance(o, AudioDelta)])
    return log.tokens, pcm, paths


def _graphs_equal_eager(pipe, requests) -> None:
    """Runs ``requests("g")`` with graphs, then ``requests("e")`` eagerly (odd turns greedy, even
    sampled): the paths taken are all graph / all eager, the tokens and PCM equal bitwise."""
    tokens_g, pcm_g, paths_g = _turns(pipe, requests("g"))
    pipe.use_graphs(False)
    pipe.reader.slots.clear()  # the eager turns read what the graph turns read, prefixes reused alike
    tokens_e, pcm_e, paths_e = _turns(pipe, requests("e"))
    assert paths_g == {"graph"} and paths_e == {"eager"}
    differ = []
    for i in range(len(tokens_g)):
        assert tokens_g[f"g{i}"] == tokens_e[f"e{i}"] and pcm_g[f"g{i}"].size > 0
        a, b = pcm_g[f"g{i}"], pcm_e[f"e{i}"]
        if not np.array_equal(a, b):
            differ.append(f"{i} ({'greedy' if i % 2 else 'sampled'}) from sample {np.flatnonzero(a != b)[0]}")
    assert not differ, f"PCM graph != eager for turns {differ}"


@pytest.mark.parametrize(("dtype", "workers"), [(torch.float32, 0), (torch.bfloat16, 0), (torch.bfloat16, 8)])
def test_decode_graphs_replay_equal_eager_bitwise(
    demo_dir: Path, dtype: torch.dtype, workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Every captured decode step (thinker token, talker frame with its code-predictor loop and
    sampling) and prompt pass (two prompts at once) replays to the eager step's results
    bitwise: the same turns (greedy and sampled, 6 at once, so several batch and length
    buckets) with graphs and with ``use_graphs(False)``
    give identical tokens and PCM, and the paths taken are all graph / all eager. ``workers``:
    the steps' first calls made on threads before the capture (``compile_workers``), every one of
    them without an error."""
    caplog.set_level(logging.INFO, logger="omnirt.stages.graphs")
    pipe = load_speech_pipeline(
        demo_dir, device="cuda", dtype=dtype, max_slots=8, max_audio_frames=40, compile_workers=workers
    )
    if workers:
        assert "warmed" in caplog.text and "failed" not in caplog.text, caplog.text
    captured = pipe.capture()
    assert all(r.graphs > 0 for r in pipe.runners)

    def requests(tag: str):
        return [
            audio_request(f"{tag}{i}", tone(1.0, 200.0 + 50 * i), max_output_tokens=10 + 3 * i,
                          temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=i)
            for i in range(6)
        ]

    _graphs_equal_eager(pipe, requests)
    # The turns arrive together: their prompts were read two to a pass, graphed and eager.
    assert pipe.calls["thinker_prompt", 2] >= 4 and pipe.calls["talker_prompt", 2] >= 4
    assert pipe.calls["audio_encoder", 2] >= 4  # and their audio in one batch of windows
    graphs = sum(r.graphs for r in pipe.runners)
    print(f"\n[gpu] {dtype}: {graphs} decode graphs captured in {captured:.1f} s; 6 turns "
          "(greedy + sampled; prompts two to a pass): tokens and PCM graph == eager bitwise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_pieces_replay_equal_eager_bitwise(demo_dir: Path, dtype: torch.dtype) -> None:
    """Prompts read in pieces (``prefill_chunk`` 64: a first piece, then later pieces at several
    piece-length and attention-length buckets, for the thinker and the talker) replay their
    graphs to the eager pieces' results: the same tokens and PCM for two long turns, greedy and
    sampled, the second read after the first one's prefix (it waits for it, then reuses it)."""
    pipe = load_speech_pipeline(
        demo_dir, device="cuda", dtype=dtype, max_slots=4, max_audio_frames=40, prefill_chunk=64
    )
    for owner in (pipe.thinker, pipe.talker):
        assert all(r.graphs > 0 for r in owner.prompt.later.values())

    def requests(tag: str):
        return [
            GenerationRequest(
                f"{tag}{i}",
                [ContextMessage("user", (TextPart(" ".join(f"word{k}" for k in range(40 + 50 * i))),))],
                max_output_tokens=8, temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=i,
            )
            for i in range(2)
        ]

    _graphs_equal_eager(pipe, requests)
    assert pipe.reader.slots.held and max(len(p.keys) for p in pipe.reader.slots.held.values()) > 64
    print(f"\n[gpu] {dtype}: prompts of 4 to 9 pieces, one after a reused prefix: tokens and PCM "
          "graph == eager bitwise")


def test_no_cuda_graphs_runs_every_decode_step_eagerly(demo_dir: Path) -> None:
    pipe = load_speech_pipeline(demo_dir, device="cuda", max_slots=4, max_audio_frames=20, cuda_graphs=False)
    pipe.capture()
    assert all(r.graphs == 0 and not r.enabled for r in pipe.runners)
    _, pcm, paths = _turns(pipe, [audio_request("r", tone(1.0), max_output_tokens=8)])
    assert paths == {"eager"} and pcm["r"].size > 0


def test_every_norm_and_decode_attention_of_the_steps_is_a_kernel(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA each residual add and RMSNorm of the thinker, talker and code-predictor layers (decode
    steps and prompt passes, eager and captured) is one launch of ``kernels/rms_norm.py``, and each
    decode step's attention ``kernels/decode_attention.py``: the eager chains never run (the
    bitwise tests above therefore cover the kernels too)."""
    from omnirt.kernels import decode_attention, rms_norm
    from omnirt.stages.speech import slots

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an eager chain ran in a speech step")

    monkeypatch.setattr(rms_norm, "add_rms_norm_reference", refuse)
    monkeypatch.setattr(decode_attention, "decode_attention_reference", refuse)
    decided: list[bool] = []

    def applies(*args: object) -> bool:
        decided.append(decode_attention.kernel_applies(*args))
        return decided[-1]

    monkeypatch.setattr(slots, "decode_attention_applies", applies)
    for graphs in (True, False):
        pipe = load_speech_pipeline(
            demo_dir, device="cuda", max_slots=4, max_audio_frames=20, cuda_graphs=graphs
        )
        pipe.capture()
        _, pcm, paths = _turns(pipe, [audio_request("r", tone(1.0), max_output_tokens=8)])
        assert paths == {"graph" if graphs else "eager"} and pcm["r"].size > 0
    assert decided and all(decided)


@pytest.mark.parametrize("kind", ["text", "audio"])
def test_prompt_prefill_never_syncs_with_the_host(demo_dir: Path, kind: str) -> None:
    """A prompt's whole prefill (inputs, RoPE index, the audio encoder's windows, thinker
    pass, first token, talker prompt, talker pass, first code; graphed and eager) is enqueued
    without one host sync, so the host never waits for the GPU's queue while it reads a prompt."""
    pipe = load_speech_pipeline(demo_dir, device="cuda", max_slots=4, max_audio_frames=20)
    pipe.capture()
    pipe.use_prefix_cache(False)
    if kind == "audio":
        request = audio_request("t", tone(1.7), text="and this?")
    else:
        request = GenerationRequest("t", [ContextMessage("user", (TextPart("hello there, how are you"),))])
    prepared = pipe.prepare(request)
    for graphs in (True, False):
        pipe.use_graphs(graphs)
        pipe.add(request, prepared)
        active = pipe._active["t"]
        pipe.reader.start(active, pipe._active.values())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            active.job.run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        done = active.job.result()  # re-raises what the sync check raised inside the job
        assert done.talker is not None
        pipe.remove("t")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_audio_encoder_windows_replay_equal_eager_and_transformers(
    demo_dir: Path, no_tf32, dtype: torch.dtype
) -> None:
    """The audio encoder over static windows replays its graph (window buckets 1 to 16; 20
    windows run as 16 + 4) equal to its eager step at the bucket bitwise, and in fp32 gives
    ``get_audio_features``' values (the GPU's other kernel choices allowed for)."""
    pipe = load_speech_pipeline(demo_dir, device="cuda", dtype=dtype, max_slots=2, max_audio_frames=20)
    pipe.capture()
    encoder = pipe.thinker.audio
    assert encoder.runner.captured_buckets == [1, 2, 4, 8, 16]
    model = pipe.thinker.thinker.model
    for seconds in [(1.0,), (0.35, 2.6, 4.1), (0.8, 75.0)]:
        parts: list = []
        for k, length in enumerate(seconds):
            parts += [AudioPart(tone(length, 200.0 + 40 * k, seed=k)), TextPart(f"part {k}")]
        request = GenerationRequest("e", [ContextMessage("user", tuple(parts))])
        host = pipe.prepare(request).prompt.model_kwargs()
        features, mask = host["input_features"], host["feature_attention_mask"]
        plan = encoder.plan(features, mask)
        with torch.no_grad():
            got = encoder.encode(plan)
            assert encoder.runner.last_path == "graph"
            eager = []
            for first in range(0, plan.windows, 16):
                rows = slice(first, first + 16)
                count = plan.chunks[rows].shape[0]
                bucket = encoder.runner.bucket_for(count)
                inputs = encoder._example(bucket)
                inputs["chunks"][:count] = plan.chunks[rows].to(inputs["chunks"])
                inputs["frames"][:count] = plan.frames[rows].to(inputs["frames"])
                inputs["tokens"][:count] = plan.tokens[rows].to(inputs["tokens"])
                eager.append(encoder._step(inputs)["hidden"][:count])
            want = torch.cat(eager).flatten(0, 1)[plan.index.cuda()]
            assert torch.equal(got, want), f"{seconds}: graph != eager"
            if dtype == torch.float32:
                hf = model.get_audio_features(features.cuda(), mask.cuda(), None, return_dict=True)
                torch.testing.assert_close(got, hf.last_hidden_state, rtol=1e-4, atol=1e-4)
        print(f"[gpu] {dtype}: audio of {seconds} s in {plan.windows} windows: graph == eager bitwise")


def test_decode_steps_never_sync_with_the_host(demo_dir: Path) -> None:
    """The thinker and talker steps (graphed and eager) launch without one host sync."""
    pipe = load_speech_pipeline(demo_dir, device="cuda", max_slots=4, max_audio_frames=20)
    pipe.capture()
    pipe.add(audio_request("r", tone(1.0), max_output_tokens=30))
    for _ in range(4):
        pipe.step()
    active = pipe._active["r"]
    assert active.talker is not None and active.talker.started
    text = [(0, 5)]
    for graphs in (True, False):
        pipe.use_graphs(graphs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            pipe.thinker.decode([active.slot], 1)
            pipe.talker.step([active.slot], text, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_decode_step_replays_its_eager_step_bitwise(demo_dir: Path, dtype: torch.dtype) -> None:
    """From the same state (five turns mid-stream, greedy and sampled), one replay of the thinker
    step and of the talker frame step leaves every state tensor and output bitwise equal to the
    eager step at the same bucket."""
    pipe = load_speech_pipeline(demo_dir, device="cuda", dtype=dtype, max_slots=8, max_audio_frames=40)
    for i in range(5):
        pipe.add(audio_request(f"r{i}", tone(1.0, 200.0 + 50 * i), max_output_tokens=40,
                               temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=i))
    rows: list = []
    for _ in range(20):
        pipe.step()
        rows = [a for a in pipe._active.values() if a.talker is not None and a.talker.started]
        if len(rows) >= 4:
            break
    assert len(rows) >= 4
    slots = [a.slot for a in rows]
    bucket = pipe._bucket(max(slots) + 1)
    text = [(0, 7 + i) for i in range(len(slots))]
    steps = {
        "thinker": (pipe.thinker, lambda: pipe.thinker.decode(slots, bucket)),
        "talker": (pipe.talker, lambda: pipe.talker.step(slots, text, bucket)),
    }
    for name, (owner, call) in steps.items():
        saved = {k: t.clone() for k, t in owner.state().items()}
        hosts = [list(kv.host_lengths) for kv in (pipe.thinker.kv, pipe.talker.kv)]
        results = []
        for graphs in (True, False):
            for k, t in owner.state().items():
                t.copy_(saved[k])
            pipe.thinker.kv.host_lengths, pipe.talker.kv.host_lengths = (list(h) for h in hosts)
            pipe.use_graphs(graphs)
            out = call()
            out = out if isinstance(out, tuple) else (out,)
            assert owner.runner.last_path == ("graph" if graphs else "eager")
            results.append(([o.clone() for o in out], {k: t.clone() for k, t in owner.state().items()}))
        (out_g, state_g), (out_e, state_e) = results
        differ = [k for k in state_g if not torch.equal(state_g[k], state_e[k])]
        pairs = enumerate(zip(out_g, out_e, strict=True))
        differ += [f"output {i}" for i, (a, b) in pairs if not torch.equal(a, b)]
        assert not differ, f"{name} step: graph != eager in {differ}"
        assert any(not torch.equal(state_g[k], saved[k]) for k in saved)  # the step did something
    print(f"\n[gpu] {dtype}: thinker and talker steps at bucket {bucket}: graph == eager bitwise in "
          "every state tensor")
