"""Streaming code2wav equals transformers' offline Qwen3OmniMoeCode2Wav, in length and value."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnirt.codecs.code2wav import Code2WavModel, Code2WavStreamer
from omnirt.codecs.code2wav.random_init import randomize_, tiny_code2wav_config
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

FRAMES = 11  # almost 3 sliding windows of 4 frames


def _hf(seed: int = 1, **overrides: object) -> Qwen3OmniMoeCode2Wav:
    return randomize_(Qwen3OmniMoeCode2Wav(tiny_code2wav_config(**overrides)).eval(), seed)


def _codes(config: Qwen3OmniMoeCode2WavConfig, frames: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.codebook_size, (config.num_quantizers, frames), generator=generator)


def _offline(hf: Qwen3OmniMoeCode2Wav, codes: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return hf(codes[None])[0, 0].numpy()


def _spy_rows(streamer: Code2WavStreamer) -> list[int]:
    """The row count of every one-frame step from now on (the bucketed step's runner)."""
    seen: list[int] = []
    step = streamer.runners.get(1, streamer.pool.step_io)

    def spy(inputs):
        seen.append(inputs["codes"].shape[0])
        return step(inputs)

    streamer.runners[1] = spy
    return seen


def _stream(streamer: Code2WavStreamer, codes: torch.Tensor) -> list[np.ndarray]:
    slot = streamer.acquire()
    chunks = [streamer.step({slot: codes[:, f]})[slot] for f in range(codes.shape[1])]
    chunks.append(streamer.finish(slot))
    return chunks


def test_geometry_of_the_published_model_explains_minus_555() -> None:
    with torch.device("meta"):
        model = Code2WavModel(Qwen3OmniMoeCode2WavConfig())
    assert model.samples_per_frame == 1920
    assert model.held_back == 555 == ((((1 * 8 + 1) * 5 + 1) * 4 + 1) * 3)
    assert [g.delay for g in model.block_geometry] == [0, 8, 45, 184, 555]
    assert model.offline_length(7) == 7 * 1920 - 555


@pytest.mark.parametrize("frames", [1, 2, 5])
def test_offline_length_rule(frames: int) -> None:
    """Only the decoder blocks shorten the signal, each by its rate: 4S -> 32S - 8 -> ..."""
    hf = _hf()
    model = Code2WavModel.from_hf(hf)
    lengths: list[int] = []
    hooks = [block.register_forward_hook(lambda _m, _a, out: lengths.append(out.shape[-1]))
             for block in hf.decoder]
    try:
        assert _offline(hf, _codes(hf.config, frames)).shape == (frames * 1920 - 555,)
    finally:
        for hook in hooks:
            hook.remove()
    s = frames
    assert lengths == [4 * s, 32 * s - 8, 160 * s - 45, 640 * s - 184, 1920 * s - 555, 1920 * s - 555,
                       1920 * s - 555]
    assert model.offline_length(frames) == frames * 1920 - 555


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # grouped KV heads, the real upsampling ratios
        {"num_key_value_heads": 2, "attention_bias": True, "sliding_window": 3, "num_hidden_layers": 3},
        {"upsample_rates": (2, 3), "upsampling_ratios": (2,), "decoder_dim": 8},  # another geometry
    ],
    ids=["tiny", "bias-mha-window3", "rates-2-3"],
)
def test_frame_by_frame_equals_offline(overrides: dict[str, object]) -> None:
    hf = _hf(**overrides)
    codes = _codes(hf.config, FRAMES)
    reference = _offline(hf, codes)
    assert reference.std() > 0.02 and np.mean(np.abs(reference) >= 1) < 0.02  # a real, unclamped signal

    model = Code2WavModel.from_hf(hf)
    chunks = _stream(Code2WavStreamer(hf, max_slots=2), codes)

    per_frame, held_back = model.samples_per_frame, model.held_back
    assert [len(c) for c in chunks] == [per_frame - held_back] + [per_frame] * (FRAMES - 1) + [0]
    streamed = np.concatenate(chunks)
    assert streamed.dtype == np.float32
    assert streamed.shape == reference.shape == (model.offline_length(FRAMES),)
    np.testing.assert_allclose(streamed, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


def test_every_prefix_is_final() -> None:
    """What a frame's step returns is never revised: each prefix equals the offline decode
    of the frames so far (here after 4 and 7 frames)."""
    hf = _hf(seed=5)
    codes = _codes(hf.config, 7, seed=9)
    streamed = np.concatenate(_stream(Code2WavStreamer(hf, max_slots=1), codes))
    for frames in (4, 7):
        prefix = _offline(hf, codes[:, :frames])
        np.testing.assert_allclose(streamed[: len(prefix)], prefix, rtol=1e-5, atol=1e-5)


def test_window_matters() -> None:
    """The sliding window is really applied: a wider window gives another output after
    ``sliding_window`` frames, and the same one before."""
    narrow, wide = _hf(seed=2), _hf(seed=2, sliding_window=8)
    codes = _codes(narrow.config, 7)
    a = np.concatenate(_stream(Code2WavStreamer(narrow, max_slots=1), codes))
    b = np.concatenate(_stream(Code2WavStreamer(wide, max_slots=1), codes))
    early = 4 * 1920 - 555  # samples that depend on the first 4 frames only
    np.testing.assert_allclose(a[:early], b[:early], rtol=1e-5, atol=1e-6)
    assert np.abs(a[early:] - b[early:]).max() > 1e-3


def test_bf16_follows_fp32() -> None:
    """The low-precision path (state and weights in bf16, RoPE frequencies and softmax in fp32)
    decodes the same signal; the GPU tests run it at full size."""
    hf = _hf(seed=6)
    codes = _codes(hf.config, 6)
    reference = _offline(hf, codes)
    streamer = Code2WavStreamer(hf, max_slots=1, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for k, t in streamer.pool.state.items() if k != "frame")
    assert streamer.model.pre_transformer.inv_freq.dtype == torch.float32
    assert next(hf.parameters()).dtype == torch.float32  # the transformers module is left as it was
    streamed = np.concatenate(_stream(streamer, codes))
    assert streamed.shape == reference.shape
    error = np.sqrt(np.mean((streamed - reference) ** 2) / np.mean(reference**2))
    assert error < 0.1


def test_bucketed_steps_run_only_the_rows_that_cover_the_busy_slots() -> None:
    """With row buckets a step runs the smallest bucket over the highest busy slot (not the whole
    pool), and a stream in slot 2 still equals the offline decode; bad buckets are refused."""
    hf = _hf()
    codes = _codes(hf.config, FRAMES)
    streamer = Code2WavStreamer(hf, max_slots=8, buckets=[1, 2, 4])
    assert streamer.buckets == [1, 2, 4, 8]
    rows_seen = _spy_rows(streamer)
    slots = [streamer.acquire() for _ in range(3)]
    assert slots == [0, 1, 2]
    streamer.release(0)
    streamer.release(1)
    chunks = [streamer.step({2: codes[:, f]})[2] for f in range(FRAMES)]
    assert set(rows_seen) == {4}  # slot 2 is covered by the bucket of 4 rows, not the pool of 8
    reference = _offline(hf, codes)
    streamed = np.concatenate(chunks)
    np.testing.assert_allclose(streamed, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    with pytest.raises(ValueError, match="buckets"):
        Code2WavStreamer(hf, max_slots=4, buckets=[0, 2])
    with pytest.raises(ValueError, match="buckets"):
        Code2WavStreamer(hf, max_slots=4, buckets=[8])


def test_compaction_moves_the_highest_streams_down_and_they_go_on_unchanged() -> None:
    """Once lower streams end, ``compact`` moves the highest into the lowest free slots (state rows
    copied), so steps run the bucket the busy count needs; a moved stream's audio still equals the
    offline decode, and bad moves change nothing."""
    hf = _hf()
    codes = [_codes(hf.config, FRAMES, seed=s) for s in (3, 4, 5)]
    streamer = Code2WavStreamer(hf, max_slots=8, buckets=[1, 2, 4])
    rows_seen = _spy_rows(streamer)
    slots = [streamer.acquire() for _ in range(3)]
    chunks: dict[int, list[np.ndarray]] = {s: [] for s in slots}
    for f in range(4):
        for slot, piece in streamer.step({s: codes[s][:, f] for s in slots}).items():
            chunks[slot].append(piece)
    assert streamer.compact() == []  # 3 streams need the bucket of 4 they run at
    streamer.release(0)
    streamer.release(1)
    assert streamer.compact() == [(2, 0)]
    assert streamer.compact() == []
    rows_seen.clear()
    for f in range(4, FRAMES):
        chunks[2].append(streamer.step({0: codes[2][:, f]})[0])
    assert set(rows_seen) == {1}
    reference = _offline(hf, codes[2])
    streamed = np.concatenate(chunks[2])
    np.testing.assert_allclose(streamed, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    with pytest.raises(ValueError, match="onto itself"):
        streamer.pool.move(0, 0)
    with pytest.raises(ValueError, match="slot must be"):
        streamer.pool.move(0, 8)
    assert streamer.free_slots == 7


def test_gathered_steps_run_only_the_streams_with_a_frame() -> None:
    """With ``gather``, a step over slots that are not the first ones runs just those rows: the
    bucketed runner is not called, an idle stream below them keeps its state bitwise, and both
    streams still equal the offline decode."""
    hf = _hf()
    codes = [_codes(hf.config, FRAMES, seed=s) for s in (3, 4)]
    streamer = Code2WavStreamer(hf, max_slots=8, buckets=[1, 2, 4], gather=True)
    calls = _spy_rows(streamer)
    held, late = streamer.acquire(), streamer.acquire()
    assert (held, late) == (0, 1)
    out = {held: [streamer.step({held: codes[0][:, 0]})[held]], late: []}
    assert calls == [1]  # slot 0 alone is the first row: the runner's bucket of 1
    before = {name: t[held].clone() for name, t in streamer.pool.state.items()}
    for f in range(FRAMES):
        out[late].append(streamer.step({late: codes[1][:, f]})[late])
    assert calls == [1]  # slot 1 alone: gathered, not a bucket of 2
    assert all(torch.equal(t[held], before[name]) for name, t in streamer.pool.state.items())
    for f in range(1, FRAMES):
        out[held].append(streamer.step({held: codes[0][:, f]})[held])
    for slot, c in ((held, codes[0]), (late, codes[1])):
        reference = _offline(hf, c)
        np.testing.assert_allclose(
            np.concatenate(out[slot]), reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max()
        )


@pytest.mark.parametrize(
    ("overrides", "sizes"),
    [
        ({}, [2, 6, 1, 2]),  # the vocoder's chunks; 6 frames pass the sliding window of 4
        ({"sliding_window": 3, "num_key_value_heads": 2, "num_hidden_layers": 3}, [5, 3, 3]),
        ({"upsample_rates": (2, 3), "upsampling_ratios": (2,), "decoder_dim": 8}, [1, 4, 4, 2]),
        ({}, [11]),  # a whole stream in one step: almost 3 windows
    ],
    ids=["chunks", "window3", "rates-2-3", "one-step"],
)
def test_steps_of_several_frames_equal_offline(overrides: dict[str, object], sizes: list[int]) -> None:
    """A stream decoded several frames a step (``[n, num_quantizers]`` codes) gives the offline
    decode, each step ``n * 1920`` samples (less the 555 held back after its first frame), and
    its state after a step of ``n`` frames is that of ``n`` one-frame steps."""
    hf = _hf(**overrides)
    codes = _codes(hf.config, sum(sizes))
    several, single = Code2WavStreamer(hf, max_slots=2), Code2WavStreamer(hf, max_slots=2)
    a, b = several.acquire(), single.acquire()
    model = several.model
    chunks, start = [], 0
    for n in sizes:
        chunks.append(several.step({a: codes[:, start : start + n].T})[a])
        for f in range(start, start + n):
            single.step({b: codes[:, f]})
        start += n
        for name, tensor in several.pool.state.items():
            torch.testing.assert_close(tensor[a], single.pool.state[name][b], rtol=1e-5, atol=1e-5, msg=name)
    per_frame, held_back = model.samples_per_frame, model.held_back
    expected = [n * per_frame - (held_back if i == 0 else 0) for i, n in enumerate(sizes)]
    assert [len(c) for c in chunks] == expected
    reference = _offline(hf, codes)
    streamed = np.concatenate(chunks)
    np.testing.assert_allclose(streamed, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


def test_streams_of_other_frame_counts_share_a_step() -> None:
    """One step decodes 6, 2, 1 and no frames of four streams (padded to the step bucket of 6):
    each stream's audio is its offline decode, and the stream given none keeps its state bitwise."""
    hf = _hf()
    codes = [_codes(hf.config, FRAMES, seed=s) for s in (3, 4, 5, 6)]
    streamer = Code2WavStreamer(hf, max_slots=4, step_buckets=(2, 6))
    assert streamer.step_buckets == [2, 6]
    steps_seen: list[int] = []
    for n in (2, 6):
        def spy(inputs, _n=n):
            steps_seen.append(inputs["codes"].shape[1])
            return streamer.pool.step_io(inputs)

        streamer.runners[n] = spy
    slots = [streamer.acquire() for _ in range(4)]
    out: dict[int, list[np.ndarray]] = {s: [] for s in slots}
    done = dict.fromkeys(slots, 0)
    plan = [{0: 6, 1: 2, 2: 1}, {0: 5, 1: 2, 3: 2}, {1: 6, 2: 6, 3: 6}, {1: 1, 2: 4, 3: 3}]
    for counts in plan:
        idle = next((s for s in slots if s not in counts), None)
        before = {k: t[idle].clone() for k, t in streamer.pool.state.items()} if idle is not None else {}
        result = streamer.step({s: codes[s][:, done[s] : done[s] + n].T for s, n in counts.items()})
        assert set(result) == set(counts)
        for s, n in counts.items():
            out[s].append(result[s])
            done[s] += n
        assert all(torch.equal(streamer.pool.state[k][idle], v) for k, v in before.items())
    assert steps_seen == [6, 6, 6, 6]
    for s in slots:
        reference = _offline(hf, codes[s][:, : done[s]])
        np.testing.assert_allclose(
            np.concatenate(out[s]), reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max(), err_msg=str(s)
        )
    streamer.step({0: codes[0][:, :2].T})
    assert steps_seen[-1] == 2
    with pytest.raises(ValueError, match="step buckets"):
        Code2WavStreamer(hf, max_slots=1, step_buckets=(0, 2))
