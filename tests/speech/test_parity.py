"""The pipeline against ``Qwen3OmniMoeForConditionalGeneration.generate`` on the same tiny weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omnirt.stages.speech.loader import load_speech_pipeline
from omnirt.stages.types import (
    AudioDelta,
    AudioPart,
    ContextMessage,
    Finished,
    GenerationRequest,
    ImagePart,
    TextDelta,
    TextPart,
)

from .conftest import TokenLog, audio_request, drain, of, png, text_request, tone

MAX_NEW = 24


def _generate(hf_model, prompt, eos: int, *, return_audio: bool = False, **extra):
    """Greedy ``generate`` of at most ``MAX_NEW`` thinker tokens, ending on ``eos``."""
    ids = prompt.input_ids
    return hf_model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        return_audio=return_audio,
        thinker_max_new_tokens=MAX_NEW,
        thinker_eos_token_id=eos,
        thinker_do_sample=False,
        **prompt.model_kwargs(),
        **extra,
    )


def _hf_tokens(hf_model, prompt, eos: int) -> list[int]:
    return _generate(hf_model, prompt, eos)[0, prompt.input_ids.shape[1] :].tolist()


def _conversation(rid: str, image: bool = True, **kw) -> GenerationRequest:
    """System prompt, an earlier exchange, then a user turn with audio, an image and text."""
    last = (AudioPart(tone(0.8, 330.0)), ImagePart(png()), TextPart("and this?"))
    return GenerationRequest(
        rid,
        [
            ContextMessage("system", (TextPart("You are a helpful voice assistant."),)),
            ContextMessage("user", (TextPart("first question"),)),
            ContextMessage("assistant", (TextPart("first answer"),)),
            ContextMessage("user", last if image else (last[0], last[2])),
        ],
        **kw,
    )


def _request(kind: str, rid: str, **kw) -> GenerationRequest:
    if kind == "text":
        return text_request(rid, "what is the weather like?", **kw)
    if kind == "audio":
        return audio_request(rid, tone(1.0), **kw)
    if kind == "image":
        return GenerationRequest(
            rid, [ContextMessage("user", (ImagePart(png()), TextPart("what is it?")))], **kw
        )
    # generate() raises for a talker prompt with audio and an image (its talker RoPE index reads a
    # config field the talker lacks): the audio-reply parity runs the conversation without the image.
    return _conversation(rid, image=kind == "conversation", **kw)


@pytest.mark.parametrize("kind", ["text", "audio", "image", "conversation"])
def test_thinker_tokens_equal_generate(pipeline, hf_model, kind: str) -> None:
    req = _request(kind, "r", output_audio=False, max_output_tokens=MAX_NEW)
    expected = _hf_tokens(hf_model, pipeline.prompts.build(req.messages), hf_model.config.im_end_token_id)
    log = TokenLog(pipeline)
    pipeline.add(req)
    outs = of(drain(pipeline), "r")
    assert log.tokens["r"] == expected
    assert len(set(expected)) > 3  # a reply that depends on its input, not one repeated token
    text = "".join(o.text for o in outs if isinstance(o, TextDelta))
    eos = hf_model.config.im_end_token_id
    # The text leaves out special tokens (a random reply may draw them).
    assert text == pipeline.tokenizer.decode([t for t in expected if t != eos], skip_special_tokens=True)
    done = outs[-1]
    assert isinstance(done, Finished)
    assert done.reason == ("stop" if eos in expected else "length")
    assert done.usage.output_text_tokens == len([t for t in expected if t != eos])


def test_audio_input_changes_the_reply(pipeline) -> None:
    log = TokenLog(pipeline)
    pipeline.add(audio_request("a", tone(1.0, 220.0), output_audio=False, max_output_tokens=12))
    pipeline.add(audio_request("b", tone(1.0, 880.0, seed=5) * 3, output_audio=False, max_output_tokens=12))
    drain(pipeline)
    assert log.tokens["a"] != log.tokens["b"]


@pytest.mark.parametrize(
    ("vocoder", "kind"), [("stream", "audio"), ("chunked", "audio"), ("stream", "conversation-no-image")]
)
def test_audio_reply_waveform_equals_generate(demo_dir: Path, hf_model, vocoder: str, kind: str) -> None:
    pipe = load_speech_pipeline(demo_dir, max_slots=2, vocoder=vocoder)
    if vocoder == "chunked":
        pipe.vocoder.left_context = 1000  # the whole history in context: exact against one full decode
    req = _request(kind, "r", max_output_tokens=MAX_NEW)
    prompt = pipe.prompts.build(req.messages)
    greedy = _hf_tokens(hf_model, prompt, hf_model.config.im_end_token_id)
    # End the reply on a token it draws early (as if it were <|im_end|>), so the talker sees the
    # end of the text: generate() feeds it ``tts_eos`` only after an EOS.
    stop_at = next(i for i, t in enumerate(greedy) if i >= 4 and t not in greedy[:i])
    eos = greedy[stop_at]
    talker_tokens = 40
    ids = prompt.input_ids
    seq, wav = _generate(
        hf_model, prompt, eos, return_audio=True, talker_max_new_tokens=talker_tokens, talker_do_sample=False
    )
    expected_wav = wav.reshape(-1).float().numpy()
    pipe.stop_token_ids = {eos}
    pipe.max_audio_frames = talker_tokens - 1  # generate() decodes the codes of all but its last token
    log = TokenLog(pipe)
    pipe.add(req)
    outs = of(drain(pipe), "r")
    assert log.tokens["r"] == seq[0, ids.shape[1] :].tolist()
    chunks = [o for o in outs if isinstance(o, AudioDelta)]
    assert len(chunks) >= 3  # streamed, not one piece at the end
    pcm = np.concatenate([c.pcm for c in chunks])
    assert pcm.dtype == np.int16
    assert pcm.shape == expected_wav.shape
    np.testing.assert_allclose(pcm / 32768.0, expected_wav, atol=1.0 / 32768 + 1e-5, rtol=0)
    assert np.abs(expected_wav).max() > 0.01  # not silence
    text = "".join(o.text for o in outs if isinstance(o, TextDelta))
    chars = [c.text_chars for c in chunks]
    assert chars == sorted(chars) and chars[-1] == len(text)
    assert sum(c.frames for c in chunks) == outs[-1].usage.output_audio_tokens


def test_talker_rope_index_matches_transformers_and_covers_audio_with_image(pipeline, hf_model) -> None:
    from omnirt.stages.speech.talker_prompt import TalkerRope

    prompt = pipeline.prompts.build(_request("image", "r").messages)
    ids, grid = prompt.input_ids, prompt.image_grid_thw
    expected, _ = hf_model.talker.get_rope_index(ids, grid, None, torch.ones_like(ids), False, None, None)
    assert torch.equal(TalkerRope(hf_model)(ids, grid, None), expected)
    # audio + image: transformers raises here; the pipeline speaks
    pipeline.add(_conversation("both", output_audio=True, max_output_tokens=4))
    outs = of(drain(pipeline), "both")
    assert outs[-1].reason == "length" and any(isinstance(o, AudioDelta) for o in outs)


def test_sampled_path_with_top_p_near_zero_equals_generate(pipeline, hf_model) -> None:
    """The sampled path (temperature 1, seeded counter-based draws) keeps only the best token
    when top-p is tiny, so it must reproduce ``generate``'s greedy tokens exactly."""
    req = _request("audio", "s", output_audio=False, max_output_tokens=MAX_NEW, temperature=1.0,
                   top_p=1e-9, seed=5)
    expected = _hf_tokens(hf_model, pipeline.prompts.build(req.messages), hf_model.config.im_end_token_id)
    log = TokenLog(pipeline)
    pipeline.add(req)
    drain(pipeline)
    assert log.tokens["s"] == expected


@pytest.mark.parametrize(
    "seconds",
    [(1.3, 2.7), (9.5, 0.4, 2.0), (0.6,), (0.35, 0.8)],
    ids=["two-parts", "windows", "short", "all-short"],
)
def test_windowed_audio_encoder_equals_get_audio_features(pipeline, seconds) -> None:
    """The audio encoder over static windows (:mod:`omnirt.stages.speech.audio_encoder`: chunks
    padded into windows, keys masked, the convolutions' outputs zeroed past the call's longest
    chunk) gives the prompt embeddings transformers builds (``get_audio_features``, then
    ``masked_scatter`` at the placeholders), to fp32 rounding: parts of several windows, parts
    under a second beside longer ones, and calls whose chunks are all short (transformers pads
    them to the longest, which the convolutions read)."""
    parts: list = []
    for k, length in enumerate(seconds):
        parts += [AudioPart(tone(length, 220.0 + 55 * k, seed=k)), TextPart(f"part {k}")]
    request = GenerationRequest("enc", [ContextMessage("user", tuple(parts))])
    prompt = pipeline.prepare(request).prompt
    thinker = pipeline.thinker
    model = thinker.thinker.model
    host = prompt.model_kwargs()
    ids = prompt.input_ids
    assert host["input_features"].shape[0] == len(seconds)
    plan, _ = thinker.audio_parts(ids, host)
    assert plan is not None and plan.windows >= len(seconds) + (seconds[0] > 8)  # a long part: windows
    with torch.no_grad():
        plan, at = thinker.audio_parts(ids, host)
        got, _ = thinker._prompt_embeds(ids, {}, (thinker.audio.encode(plan), at))
        embeds = model.get_input_embeddings()(ids)
        _, _, mask = model.get_placeholder_mask(ids, inputs_embeds=embeds)
        features = host["input_features"].to(thinker.dtype)
        audio = model.get_audio_features(features, host["feature_attention_mask"], None, return_dict=True)
        want = embeds.masked_scatter(mask, audio.last_hidden_state)[0]
    placed = (got != embeds[0]).any(dim=-1).sum()
    assert got.shape == want.shape and placed == audio.last_hidden_state.shape[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_audio_of_several_prompts_encodes_as_one_batch(pipeline) -> None:
    """Prompts read at once have their audio encoded in one batch of windows
    (``AudioEncoder.execute``): each prompt gets its own tokens, as encoded alone (to rounding:
    other matmul shapes)."""
    from omnirt.stages.speech.audio_encoder import AudioCall

    encoder = pipeline.thinker.audio
    plans = []
    for k, seconds in enumerate((1.0, 9.5, 0.4)):
        request = GenerationRequest(f"p{k}", [ContextMessage("user", (AudioPart(tone(seconds, seed=k)),))])
        host = pipeline.prepare(request).prompt.model_kwargs()
        plans.append(encoder.plan(host["input_features"], host["feature_attention_mask"]))
    with torch.no_grad():
        together = encoder.execute([AudioCall(encoder, p) for p in plans])
        for plan, got in zip(plans, together, strict=True):
            alone = encoder.encode(plan)
            assert got.shape == alone.shape == (plan.index.shape[0], alone.shape[-1])
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
