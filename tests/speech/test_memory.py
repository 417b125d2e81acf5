"""The slots' memory plan at real size (the published config, no weights) and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omnirt.stages.speech.memory import GiB, kv_bytes_per_token, plan_slots, slot_bytes
from transformers import Qwen3OmniMoeConfig

CONFIG = Path(__file__).resolve().parents[2] / "benchmarks/models/qwen3-omni-30b-a3b-instruct/config.json"


@pytest.fixture(scope="module")
def config() -> Qwen3OmniMoeConfig:
    return Qwen3OmniMoeConfig(**json.loads(CONFIG.read_text()))


def test_real_size_cache_sizes(config) -> None:
    # 48 layers x 4 KV heads x 128 dims x (key, value) x 2 bytes; talker 20 x 2 x 128.
    assert kv_bytes_per_token(config.thinker_config.text_config, 2) == 96 * 1024
    assert kv_bytes_per_token(config.talker_config.text_config, 2) == 20 * 1024
    plan = slot_bytes(config, max_slots=32, max_context=4096, max_audio_frames=2048, element_size=2)
    assert plan.thinker_bytes == 32 * 4097 * 96 * 1024  # the "about 13 GB" (12.0 GiB)
    assert plan.talker_bytes == 32 * (4096 + 2048 + 17) * 20 * 1024
    assert "32 slots x 4096 context tokens" in plan.describe()


def test_the_longest_context_that_fits_is_chosen(config) -> None:
    kw = dict(max_slots=128, max_context=None, default_context=4096, max_audio_frames=512, element_size=2)
    roomy = plan_slots(config, free_bytes=200 * GiB, **kw)
    assert roomy.max_context == 4096
    tight = plan_slots(config, free_bytes=40 * GiB, **kw)  # 128 x 4096 would need 51 GiB of thinker cache
    assert tight.max_context in (1024, 2048) and tight.total_bytes <= 0.9 * 40 * GiB
    assert plan_slots(config, free_bytes=None, **kw).max_context == 4096  # CPU: no number to plan with


def test_configurations_that_cannot_fit_are_refused_with_the_sizes(config) -> None:
    with pytest.raises(ValueError, match=r"128 slots x 4096 context tokens.*lower --max-sessions"):
        plan_slots(config, max_slots=128, max_context=4096, default_context=4096, max_audio_frames=512,
                   element_size=2, free_bytes=40 * GiB)
    with pytest.raises(ValueError, match="lower --max-sessions"):
        plan_slots(config, max_slots=4096, max_context=None, default_context=4096, max_audio_frames=512,
                   element_size=2, free_bytes=10 * GiB)
    with pytest.raises(ValueError, match="at least 1"):
        plan_slots(config, max_slots=0, max_context=None, default_context=4096, max_audio_frames=512,
                   element_size=2, free_bytes=None)
