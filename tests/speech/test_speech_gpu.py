"""The speech pipeline on CUDA: fp32 parity with ``generate`` on the GPU, bf16 end to end, the
streaming vocoder on CUDA graphs, and the latency of a 1 s audio turn (printed; run with
``pytest -m gpu -s tests/speech``)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omnirt.codecs.audio import float_to_int16
from omnirt.stages.graphs import CudaGraphRunner
from omnirt.stages.speech.code2wav import StreamingVocoder, make_vocoder
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.speech.sampling import SamplingParams, choose, choose_rows_tensor
from omnirt.stages.types import AudioDelta, Finished, TextDelta

from .conftest import TokenLog, audio_request, drain, of, tone

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_cuda_fp32_reply_equals_generate(demo_dir: Path, no_tf32) -> None:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    hf = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(demo_dir)).eval().cuda()
    pipe = load_speech_pipeline(demo_dir, device="cuda", dtype=torch.float32, max_slots=4)
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
    pipe.add(req)
    outs = of(drain(pipe), "r")
    assert log.tokens["r"] == seq[0, ids.shape[1] :].tolist()
    pcm = np.concatenate([o.pcm for o in outs if isinstance(o, AudioDelta)])
    expected = wav.reshape(-1).float().cpu().numpy()
    assert pcm.shape == expected.shape
    np.testing.assert_allclose(pcm / 32768.0, expected, atol=2e-4, rtol=0)


def test_cuda_vocoder_replays_graphs_bitwise(demo_dir: Path) -> None:
    """The pipeline's streaming vocoder captures its step at load and replays it every tick;
    the audio of a turn equals an eager vocoder's (``graphs=False``) on the same codes, bitwise."""
    pipe = load_speech_pipeline(
        demo_dir, device="cuda", dtype=torch.bfloat16, max_slots=4, max_audio_frames=30
    )
    vocoder = pipe.vocoder
    assert isinstance(vocoder, StreamingVocoder)
    runner = vocoder.streamer.runner
    assert isinstance(runner, CudaGraphRunner) and runner.captured_buckets == [4]
    pushed: list[torch.Tensor] = []
    pulled: list[np.ndarray] = []
    paths: set[str] = set()
    push, pull = vocoder.push, vocoder.pull

    def record_push(key: str, frame: torch.Tensor) -> None:
        pushed.append(frame.clone())
        push(key, frame)

    def record_pull(finishing):
        runner.last_path = ""  # stays empty on ticks with no frame to decode
        out = pull(finishing)
        paths.add(runner.last_path)
        pulled.extend(pcm for pcm, _ in out.values())
        return out

    vocoder.push, vocoder.pull = record_push, record_pull  # type: ignore[method-assign]
    pipe.add(audio_request("r", tone(1.0), max_output_tokens=12))
    outs = of(drain(pipe), "r")
    assert isinstance(outs[-1], Finished) and outs[-1].reason != "error"
    assert len(pushed) > 8 and paths - {""} == {"graph"}
    assert vocoder.streamer.free_slots == 4

    eager = make_vocoder(pipe.model.code2wav, "stream", max_streams=4, graphs=False)
    assert not isinstance(eager.streamer.runner, CudaGraphRunner)  # type: ignore[attr-defined]
    eager.open("r")
    for frame in pushed:
        eager.push("r", frame)
    expected, frames = eager.pull({"r"})["r"]
    got = np.concatenate(pulled)
    assert frames == len(pushed) and got.shape == expected.shape == (len(pushed) * 1920 - 555,)
    assert np.array_equal(got, expected)
    sent = np.concatenate([o.pcm for o in outs if isinstance(o, AudioDelta)])
    assert np.array_equal(sent, float_to_int16(expected))
    print(
        f"\n[gpu] speech pipeline bf16: vocoder replayed its CUDA graph (bucket 4) for {len(pushed)} "
        "frames; PCM == graphs=False vocoder bitwise"
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


def test_choose_rows_tensor_never_syncs_with_the_host() -> None:
    """Mixed greedy and sampled rows (top-k and top-p on, generators on the GPU) are chosen on
    the device without a host sync, and equal choosing each row on its own."""
    logits = torch.randn(4, 3072, generator=torch.Generator().manual_seed(0)).cuda()

    def params(seed: int) -> list[SamplingParams]:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        return [
            SamplingParams(),
            SamplingParams(1.0, 0.8, 50, gen),
            SamplingParams(),
            SamplingParams(0.9, 0.5, 8, gen),
        ]

    choose_rows_tensor(logits, params(1))  # first call: lazy initialisation may sync
    rows = params(2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        picked = choose_rows_tensor(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert picked.device.type == "cuda"
    assert picked.tolist() == [choose(row, p) for row, p in zip(logits, params(2), strict=True)]
