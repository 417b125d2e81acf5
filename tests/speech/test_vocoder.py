"""The speech pipeline's streaming vocoder: streams keep their audio when others close and it compacts."""

from __future__ import annotations

import numpy as np
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
