"""The duplex LM's fp8 KV storage against bf16 storage on the same tiny weights, teacher-forced
(both take the bf16 run's tokens, so only the KV storage differs), and its memory."""

from __future__ import annotations

import pytest
import torch
from omnirt.stages.duplex.lm import DuplexLM, DuplexSampling
from omnirt.stages.duplex.loader import load_duplex_lm

from .reference import K, run_stream, save_reference, tiny_config

GREEDY = DuplexSampling(text_temperature=0.0, audio_temperature=0.0, seed=0)
FRAMES = 24
#: The stated tolerance (docs/duplex.md): fp8 logits within this share of the logits' spread
#: (max abs difference / std) of bf16 storage's, and argmax agreement on at least this share.
LOGIT_TOLERANCE, AGREEMENT = 0.15, 0.95


class _Forced:
    """Records each sampler's logits; with ``tokens``, returns those instead of its own draws."""

    def __init__(self, lm: DuplexLM, tokens: dict[str, list[torch.Tensor]] | None = None) -> None:
        self.logits: dict[str, list[torch.Tensor]] = {"text": [], "audio": []}
        self.draws: dict[str, list[torch.Tensor]] = {"text": [], "audio": []}
        for name, sampler in (("text", lm.text_sampling), ("audio", lm.audio_sampling)):
            draw = sampler.draw_with

            def spy(logits, uniform, draw=draw, name=name):
                self.logits[name].append(logits.float().clone())
                out = draw(logits, uniform)
                if tokens is not None:
                    out = tokens[name][len(self.logits[name]) - 1].clone()
                self.draws[name].append(out.clone())
                return out

            sampler.draw_with = spy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("moshi-fp8")
    save_reference(path, seed=3, sliding_window=16, max_position_embeddings=16)
    return path


def _lm(path, kv_dtype: str) -> DuplexLM:
    return load_duplex_lm(
        path, max_slots=2, device="cpu", dtype=torch.bfloat16, graphs=False, kv_dtype=kv_dtype
    )[0]


def test_fp8_kv_is_close_to_bf16_kv_teacher_forced(checkpoint):
    user = torch.randint(0, 64, (FRAMES, K), generator=torch.Generator().manual_seed(5))
    exact = _lm(checkpoint, "auto")
    fp8 = _lm(checkpoint, "fp8")
    assert exact.keys[0].dtype == torch.bfloat16 and fp8.keys[0].dtype == torch.float8_e4m3fn
    reference = _Forced(exact)
    exact.start(1, GREEDY)
    run_stream(exact, 1, user)  # past the 16-frame window: the ring wraps
    forced = _Forced(fp8, reference.draws)
    fp8.start(1, GREEDY)
    run_stream(fp8, 1, user)
    agree = total = 0
    for name in ("text", "audio"):
        for want, got in zip(reference.logits[name], forced.logits[name], strict=True):
            want, got = want[1], got[1]  # the active row
            spread = want.std()
            assert (got - want).abs().max() / spread < LOGIT_TOLERANCE
            agree += int(want.argmax() == got.argmax())
            total += 1
    assert total == FRAMES * (1 + K) and agree / total >= AGREEMENT
    # not vacuous: the caches really differ, and the tokens are not a constant stream
    assert not torch.equal(exact.keys[0][1].float(), fp8.keys[0][1].float())
    assert torch.cat(reference.draws["text"]).unique().numel() > 3


def test_fp8_halves_the_kv_memory_and_its_scales_follow_the_slots(checkpoint):
    exact, fp8 = _lm(checkpoint, "auto"), _lm(checkpoint, "fp8")
    config = tiny_config(sliding_window=16, max_position_embeddings=16)
    columns = 2 * (16 + 1)  # slots x (window + the idle rows' scratch column)
    for lm, kind in ((exact, "auto"), (fp8, "fp8")):
        assert lm.kv_bytes == columns * DuplexLM.kv_bytes_per_frame(config, kind, torch.bfloat16)
    assert fp8.kv_bytes / exact.kv_bytes == (16 + 4) / 32  # head dim 16: fp8 + an fp32 scale
    user = torch.randint(0, 64, (3, K), generator=torch.Generator().manual_seed(6))
    fp8.start(0, GREEDY)
    run_stream(fp8, 0, user, batch=2)
    scales = fp8.key_scales[0]
    assert bool((scales[0, :, :3] != 1).all())  # the written positions
    assert bool((scales[0, :, 3:16] == 1).all())
    assert bool((scales[1, :, :16] == 1).all())  # the idle slot's window untouched (16: its scratch)
    with pytest.raises(ValueError, match="kv_dtype"):
        _lm(checkpoint, "int4")


def test_the_served_demo_pipeline_runs_on_an_fp8_cache():
    from omnirt.stages.duplex.pipeline import DuplexPipeline
    from omnirt.stages.factory import build_duplex_pipeline
    from omnirt.stages.types import AudioDelta, Finished

    from .helpers import request, speech

    pipeline = build_duplex_pipeline("demo", device="cpu", max_slots=2, kv_dtype="fp8", max_frames=6)
    assert isinstance(pipeline, DuplexPipeline)
    assert pipeline.lm.kv_dtype == "fp8" and pipeline.lm.keys[0].dtype == torch.float8_e4m3fn
    assert pipeline.lm.max_frames == 6
    r = request("a")
    pipeline.add(r)
    r.input.push(speech(8, seed=2))
    outputs = []
    while pipeline.has_work():
        outputs += [o for _, o in pipeline.step()]
    # one frame per frame, past the window too: the ring wraps (a conversation has no length end)
    assert sum(isinstance(o, AudioDelta) for o in outputs) == 8
    assert not any(isinstance(o, Finished) for o in outputs)
    assert pipeline.lm.frames(pipeline.slot_of("a")) == 8
    assert bool((pipeline.lm.key_scales[0][0, :, :6] != 1).all())  # every position went through fp8
