"""The speech pipeline's streaming vocoder: streams keep their audio when others close and it compacts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnirt.codecs.code2wav.random_init import randomize_, tiny_code2wav_config
from omnirt.stages.speech.code2wav import StreamingVocoder, make_vocoder
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

FRAMES = 9


def test_streams_go_on_after_lower_ones_close_and_the_rest_move_down() -> None:
    hf = randomize_(Qwen3OmniMoeCode2Wav(tiny_code2wav_config()).eval(), 1)
    vocoder = make_vocoder(hf, "auto", max_streams=8, buckets=[1, 2, 4])
    assert isinstance(vocoder, StreamingVocoder)
    generator = torch.Generator().manual_seed(5)
    codes = {
        k: torch.randint(0, hf.config.codebook_size, (FRAMES, hf.config.num_quantizers), generator=generator)
        for k in "abcd"
    }
    pcm: dict[str, list[np.ndarray]] = {k: [] for k in "abcd"}

    def tick(keys: str, f: int) -> None:
        for k in keys:
            vocoder.push(k, codes[k][f])
        for k, (piece, _) in vocoder.pull(set()).items():
            pcm[k].append(piece)

    for k in "abc":
        vocoder.open(k)
    for f in range(3):
        tick("abc", f)
    vocoder.close("a")
    vocoder.close("b")  # c (slot 2) moves down to slot 0
    assert vocoder._slot == {"c": 0} and vocoder.streamer.compact() == []
    for f in range(3, FRAMES):
        tick("c", f)
    for piece, _ in vocoder.pull({"c"}).values():
        pcm["c"].append(piece)
    with torch.no_grad():
        reference = hf(codes["c"].T[None])[0, 0].numpy()
    streamed = np.concatenate(pcm["c"])
    np.testing.assert_allclose(streamed, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    vocoder.open("d")
    assert vocoder._slot["d"] == 1
    tick("d", 0)
    vocoder.close("c")  # d moves down to 0
    assert vocoder._slot == {"d": 0}
    vocoder.close("d")
    assert vocoder.streamer.free_slots == 8


@pytest.mark.parametrize("share_runs", [True, False], ids=["shared", "own"])
def test_the_vocoder_decodes_once_a_chunk(share_runs: bool) -> None:
    """A pull decodes only when some stream's chunk is due (2 frames, then 6) or a finishing
    stream has frames left. Shared runs (graphed steps, which compute every row anyway): every
    stream's queued frames go along, up to the due ones' count, so streams that started apart
    share the runs from the second one on. Own runs (eager steps, which gather their rows): each
    stream decodes its own chunks. Each stream's audio is its offline decode either way, and
    pulls in between cost no step."""
    hf = randomize_(Qwen3OmniMoeCode2Wav(tiny_code2wav_config()).eval(), 2)
    vocoder = StreamingVocoder(hf, max_streams=4, graphs=False)
    assert not vocoder.share_runs  # eager: gathered rows
    vocoder.share_runs = share_runs
    generator = torch.Generator().manual_seed(7)
    frames = {"a": 20, "b": 15}
    codes = {
        k: torch.randint(0, hf.config.codebook_size, (n, hf.config.num_quantizers), generator=generator)
        for k, n in frames.items()
    }
    steps: list[dict[int, int]] = []
    step = vocoder.streamer.step

    def spy(given):
        steps.append({slot: len(c) for slot, c in given.items()})
        return step(given)

    vocoder.streamer.step = spy  # type: ignore[method-assign]
    pcm: dict[str, list[np.ndarray]] = {k: [] for k in frames}
    got: dict[str, list[int]] = {k: [] for k in frames}
    pushed = dict.fromkeys(frames, 0)
    vocoder.open("a")
    for tick in range(24):
        if tick == 3:
            vocoder.open("b")
        for k in frames:
            if k in vocoder._slot and pushed[k] < frames[k]:
                vocoder.push(k, codes[k][pushed[k]])
                pushed[k] += 1
        finishing = {k for k in frames if k in vocoder._slot and pushed[k] == frames[k]}
        for k, (piece, n) in vocoder.pull(finishing).items():
            pcm[k].append(piece)
            got[k].append(n)
        for k in finishing:
            vocoder.close(k)
    if share_runs:
        # a: its first chunk at its 2nd frame (tick 1); b joins at tick 3 and its first chunk at
        # tick 4 (a step of 2 frames) takes 2 of a's 3 along; a's next chunk at tick 9 takes b's 5,
        # and from then on both go out together every 6 frames; b's flush at tick 17 takes a's 2
        # along, and a flushes its last 2 at tick 19.
        assert got == {"a": [2, 2, 6, 6, 2, 2], "b": [2, 5, 6, 2]}
        assert [sorted(s.values()) for s in steps] == [[2], [2, 2], [5, 6], [6, 6], [2, 2], [2]]
    else:  # each at its own ticks: a at 1, 7, 13, 19; b at 4, 10, 16 and its flush at 17
        assert got == {"a": [2, 6, 6, 6], "b": [2, 6, 6, 1]}
        assert [list(s.values()) for s in steps] == [[2], [2], [6], [6], [6], [6], [1], [6]]
    for k, c in codes.items():
        with torch.no_grad():
            reference = hf(c.T[None])[0, 0].numpy()
        streamed = np.concatenate(pcm[k])
        np.testing.assert_allclose(streamed, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


def test_a_first_audio_taken_along_waits_for_its_whole_first_chunk() -> None:
    """Shared runs: a new stream's first frame decoded in another stream's run is held, not sent
    as a one-frame first audio; it goes out with the next frame (its first chunk of 2), or alone
    when the stream finishes with it."""
    hf = randomize_(Qwen3OmniMoeCode2Wav(tiny_code2wav_config()).eval(), 3)
    vocoder = StreamingVocoder(hf, max_streams=4, graphs=False)
    vocoder.share_runs = True
    frame = torch.zeros(hf.config.num_quantizers, dtype=torch.long)
    vocoder.open("a")
    for _ in range(2):
        vocoder.push("a", frame)
    assert {k: n for k, (_, n) in vocoder.pull(()).items()} == {"a": 2}
    for _ in range(5):
        vocoder.push("a", frame)
        assert vocoder.pull(()) == {}
    vocoder.open("c")
    vocoder.open("d")
    for k in "acd":
        vocoder.push(k, frame)
    out = vocoder.pull(())  # a's chunk of 6 is due; c's and d's first frames go along, held
    assert {k: n for k, (_, n) in out.items()} == {"a": 6}
    vocoder.push("c", frame)
    out = vocoder.pull(())
    assert {k: n for k, (_, n) in out.items()} == {"c": 2}
    assert out["c"][0].size == 2 * 1920 - 555
    out = vocoder.pull({"d"})  # d ends with its one frame, decoded already: sent as it is
    assert {k: n for k, (_, n) in out.items()} == {"d": 1} and out["d"][0].size == 1920 - 555
    assert vocoder.pull(()) == {}
