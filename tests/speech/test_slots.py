"""The static slot decoder: rows are slots, idle rows leave their slot untouched, attention
reads each slot's cache in place under any length bucket that covers it."""

from __future__ import annotations

import pytest
import torch
from omnirt.stages.speech.hf_compat import thinker_rope_index, thinker_text_model
from omnirt.stages.speech.slots import SlotDecoder, length_buckets
from omnirt.stages.types import AudioPart, ContextMessage, GenerationRequest, ImagePart, TextPart

from .conftest import audio_request, drain, png, run_pieces, tone


@pytest.fixture
def decoder(hf_model) -> SlotDecoder:
    return SlotDecoder(
        thinker_text_model(hf_model.thinker), num_slots=4, max_len=40, device=torch.device("cpu"),
        dtype=torch.float32,
    )


def _fill(decoder: SlotDecoder, lengths: list[int], seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for k, v in zip(decoder.keys, decoder.values, strict=True):
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    decoder.lengths.copy_(torch.tensor(lengths))
    decoder.host_lengths = list(lengths)


def _inputs(decoder: SlotDecoder, batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = decoder.layers[0].self_attn.q_proj.in_features
    return torch.randn(batch, hidden, generator=gen), torch.tensor([5, 9, 3, 7][:batch])


def test_idle_rows_keep_their_slot_bitwise(decoder: SlotDecoder) -> None:
    _fill(decoder, [4, 8, 2, 6])
    before = [(k.clone(), v.clone()) for k, v in zip(decoder.keys, decoder.values, strict=True)]
    x, pos = _inputs(decoder, 4)
    active = torch.tensor([False, True, False, True])
    decoder.step(x, pos, active, attend=16)
    assert decoder.lengths.tolist() == [4, 9, 2, 7]
    for (k0, v0), k, v in zip(before, decoder.keys, decoder.values, strict=True):
        for slot in (0, 2):  # idle: the whole slot (up to max_len) unchanged
            assert torch.equal(k[slot, :, :40], k0[slot, :, :40])
            assert torch.equal(v[slot, :, :40], v0[slot, :, :40])
        for slot, at in ((1, 8), (3, 6)):  # active: exactly one new entry, at its length
            changed = (k[slot, :, :40] != k0[slot, :, :40]).any(dim=(0, 2)).nonzero().flatten().tolist()
            assert changed == [at]


def test_a_row_decodes_the_same_alone_in_any_bucket_and_attention_length(decoder: SlotDecoder) -> None:
    """Slot 1's hidden state depends on its own cache only: alone or beside busy rows, under the
    tightest or a longer attention bucket (masked, read in place), the result is the same."""
    _fill(decoder, [4, 8, 2, 6])
    x, pos = _inputs(decoder, 4)
    snapshot = [(k.clone(), v.clone()) for k, v in zip(decoder.keys, decoder.values, strict=True)]
    results = []
    for batch, attend, busy in ((2, 9, [1]), (4, 40, [0, 1, 2, 3]), (4, 16, [1, 3])):
        for (k0, v0), k, v in zip(snapshot, decoder.keys, decoder.values, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        decoder.lengths.copy_(torch.tensor([4, 8, 2, 6]))
        active = torch.zeros(batch, dtype=torch.bool)
        active[busy] = True
        results.append(decoder.step(x[:batch], pos[:batch], active, attend)[1])
    for r in results[1:]:
        torch.testing.assert_close(r, results[0], atol=1e-5, rtol=1e-5)


def test_length_buckets_cover_every_length() -> None:
    assert length_buckets(1000) == [256, 512, 1000]
    assert length_buckets(256) == [256]
    assert length_buckets(100) == [100]
    assert length_buckets(4096, smallest=1024) == [1024, 2048, 4096]


def test_idle_rows_content_never_changes_the_active_rows_bits(decoder: SlotDecoder) -> None:
    """Whatever an idle slot held (stale cache, stale inputs), the active rows' results are the
    same bits: idle rows compute on zeros and attend to nothing."""
    results = []
    for stale in (0, 7):
        _fill(decoder, [4, 8, 2, 6], seed=3)
        gen = torch.Generator().manual_seed(stale)
        for k, v in zip(decoder.keys, decoder.values, strict=True):  # idle slots 0 and 2: other history
            k[[0, 2]] = torch.randn(k[[0, 2]].shape, generator=gen)
            v[[0, 2]] = torch.randn(v[[0, 2]].shape, generator=gen)
        x, pos = _inputs(decoder, 4)
        x[[0, 2]] = torch.randn(2, x.shape[1], generator=gen) * (stale + 1)
        active = torch.tensor([False, True, False, True])
        results.append(decoder.step(x, pos, active, attend=16)[[1, 3]])
    assert torch.equal(results[0], results[1])


def test_graphed_steps_give_each_static_input_its_own_buffer(pipeline) -> None:
    from omnirt.stages.graphs import check_distinct

    check_distinct(pipeline.thinker._example(4))
    check_distinct(pipeline.talker._example(4))


@pytest.mark.parametrize("with_image", [False, True])
def test_prompt_pass_equals_the_transformers_prefill(pipeline, hf_model, with_image: bool) -> None:
    """The thinker's static-length prompt pass (padded to its bucket) leaves the slot's cache,
    the embeddings and the accepted hidden state of a transformers forward, and touches no other
    slot; the image prompt checks the deepstack features."""
    if with_image:
        req = GenerationRequest("r", [ContextMessage("user", (ImagePart(png()), TextPart("what is it?")))])
    else:
        req = audio_request("r", tone(0.7))
    prompt = pipeline.prompts.build(req.messages)
    thinker = pipeline.thinker
    others = [k[[0, 2]].clone() for k in thinker.kv.keys]
    done = run_pieces(thinker.forward_prompt(1, prompt))
    ids = prompt.input_ids
    extra = prompt.model_kwargs()
    audio_lengths = extra["feature_attention_mask"].sum(-1) if "feature_attention_mask" in extra else None
    positions, _ = thinker_rope_index(hf_model.thinker)(
        ids, extra.get("image_grid_thw"), None, torch.ones_like(ids), False, audio_lengths, None
    )
    with torch.no_grad():
        ref = hf_model.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions,
                               use_cache=True, output_hidden_states=True, **extra)
    n = ids.shape[1]
    assert done.length == n and bool(thinker.prompt.first.length_for(n) > n)  # padded
    cache = ref.cache if getattr(ref, "cache", None) is not None else ref.past_key_values
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(thinker.kv.keys[i][1, :, :n], layer.keys[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(thinker.kv.values[i][1, :, :n], layer.values[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(done.embeds, ref.hidden_states[0][0])
    accepted = ref.hidden_states[thinker.accept_layer][0]
    torch.testing.assert_close(done.accepted, accepted, atol=1e-4, rtol=1e-4)
    assert int(done.token) == int(ref.logits[0, -1].argmax())
    for before, k in zip(others, thinker.kv.keys, strict=True):
        assert torch.equal(k[[0, 2]], before)


@pytest.mark.parametrize("with_image", [False, True])
def test_a_prompt_read_in_pieces_equals_the_transformers_prefill(demo_dir, hf_model, with_image) -> None:
    """A prompt read ``prefill_chunk`` tokens at a time (each later piece attending to the
    slot's cache, a resumption per piece) leaves the same cache, accepted hidden state and first
    token as one transformers forward over the whole prompt; the image prompt's deepstack
    features are sliced with it, and no other slot is touched."""
    from omnirt.stages.speech.loader import load_speech_pipeline

    pipe = load_speech_pipeline(demo_dir, max_slots=4, max_audio_frames=30, prefill_chunk=64)
    words = " ".join(f"word{i}" for i in range(60))
    parts = (ImagePart(png()), TextPart(words)) if with_image else (TextPart(words),)
    prompt = pipe.prompts.build([ContextMessage("user", parts)])
    n = prompt.length
    assert n > 3 * 64, n
    thinker = pipe.thinker
    others = [k[[0, 2]].clone() for k in thinker.kv.keys]
    pieces = thinker.forward_prompt(1, prompt)
    resumed, answer = 0, None
    with torch.no_grad():
        while True:
            try:
                call = pieces.send(answer)
            except StopIteration as stop:
                done = stop.value
                break
            if call is None:  # a tick ends between pieces
                resumed, answer = resumed + 1, None
            else:  # a piece to run: the driver's part (prefill.advance)
                answer = call.owner.execute([call])[0]
    assert resumed == -(-n // 64) - 1  # a yield between pieces
    ids = prompt.input_ids
    extra = prompt.model_kwargs()
    positions, _ = thinker_rope_index(hf_model.thinker)(
        ids, extra.get("image_grid_thw"), None, torch.ones_like(ids), False, None, None
    )
    with torch.no_grad():
        ref = hf_model.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions,
                               use_cache=True, output_hidden_states=True, **extra)
    cache = ref.cache if getattr(ref, "cache", None) is not None else ref.past_key_values
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(thinker.kv.keys[i][1, :, :n], layer.keys[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(thinker.kv.values[i][1, :, :n], layer.values[0], atol=1e-4, rtol=1e-4)
    accepted = ref.hidden_states[thinker.accept_layer][0]
    assert done.length == n and done.accepted.shape == accepted.shape
    torch.testing.assert_close(done.accepted, accepted, atol=1e-4, rtol=1e-4)
    assert int(done.token) == int(ref.logits[0, -1].argmax())
    for before, k in zip(others, thinker.kv.keys, strict=True):
        assert torch.equal(k[[0, 2]], before)


def test_prompt_passes_feed_their_graphs_the_captured_shapes_and_dtypes(pipeline) -> None:
    """A prompt's pass inputs match the example inputs its graphs are captured with (shape past
    the batch, dtype), for audio, image and text prompts, first pieces and pieces after a reused
    prefix: else it would silently run eagerly (transformers gives audio prompts float
    positions)."""
    from omnirt.stages.graphs import CudaGraphRunner, _Captured

    seen: list[tuple[object, int, int | None, dict]] = []
    for owner in (pipeline.thinker, pipeline.talker):
        for piece, bucketed in [(None, owner.prompt.first), *owner.prompt.later.items()]:
            for length, runner in bucketed.runners.items():
                def spy(self, inputs, length=length, owner=owner, piece=piece):
                    seen.append((owner, length, piece, inputs))
                    return CudaGraphRunner.__call__(self, inputs)

                runner.__class__ = type("Spied", (CudaGraphRunner,), {"__call__": spy})
    try:
        context = ContextMessage("user", (TextPart("some context " * 40),))
        audio = ContextMessage("user", (AudioPart(tone(0.6)), TextPart("hi")))
        image = ContextMessage("user", (ImagePart(png()), TextPart("what is it?")))
        for req in (
            GenerationRequest("a", [context, audio], max_output_tokens=4),
            GenerationRequest("i", [context, image], max_output_tokens=4),
        ):
            pipeline.add(req)
            drain(pipeline)
    finally:
        for owner in (pipeline.thinker, pipeline.talker):
            for bucketed in owner.prompt.runners:
                for runner in bucketed.runners.values():
                    runner.__class__ = CudaGraphRunner
    assert {type(o).__name__ for o, _, _, _ in seen} == {"Thinker", "Talker"} and len(seen) >= 4
    # The second prompt starts with the first one's context: read after that prefix.
    assert {p is None for _, _, p, _ in seen} == {True, False}
    for owner, length, piece, inputs in seen:
        example = owner._prompt_example(1, length, piece)
        assert CudaGraphRunner._matches(None, _Captured(None, example, {}), inputs), (
            {k: (tuple(v.shape), v.dtype) for k, v in inputs.items()},
            {k: (tuple(v.shape), v.dtype) for k, v in example.items()},
        )
