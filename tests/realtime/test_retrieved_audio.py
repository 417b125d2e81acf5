"""``conversation.item.retrieved`` keeps an item's audio exactly while its base64 fits the limit,
whatever the format (the size is checked before converting, the result is as if after)."""

from __future__ import annotations

import numpy as np
import pytest
from omnirt.codecs.audio import b64encode, encode_audio
from omnirt.realtime.protocol.items import MAX_RETRIEVED_AUDIO_B64, item_to_wire
from omnirt.sessions.items import InputAudio, MessageItem, OutputAudio


def _fits(pcm: np.ndarray, fmt: str) -> bool:
    return len(b64encode(encode_audio(pcm, fmt))) <= MAX_RETRIEVED_AUDIO_B64  # type: ignore[arg-type]


def _last_fitting(fmt: str) -> int:
    """The most samples whose encoding fits (bisection on the real encoder)."""
    lo, hi = 0, MAX_RETRIEVED_AUDIO_B64 * 4
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(np.zeros(mid, np.int16), fmt) else (lo, mid)
    return lo


@pytest.mark.parametrize("fmt", ["audio/pcm", "audio/pcmu", "audio/pcma"])
def test_audio_kept_exactly_while_it_fits(fmt: str) -> None:
    edge = _last_fitting(fmt)
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 3, edge - 2, edge - 1, edge, edge + 1, edge + 2, edge + 200, edge * 2):
        pcm = (rng.standard_normal(n) * 3000).astype(np.int16)
        out_part = OutputAudio(transcript="hi")
        out_part.append(pcm, 2)
        in_part = InputAudio(pcm.astype(np.float32) / 32768)
        for part, role, key in ((out_part, "assistant", "output_format"), (in_part, "user", "input_format")):
            wire = item_to_wire(MessageItem("item_x", role, [part]), with_audio=True, **{key: fmt})
            content = wire["content"][0]
            expected = b64encode(encode_audio(pcm, fmt))  # type: ignore[arg-type]
            if len(expected) <= MAX_RETRIEVED_AUDIO_B64:
                assert content["audio"] == expected, (fmt, n, role)
            else:
                assert "audio" not in content, (fmt, n, role)
