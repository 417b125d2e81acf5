"""A real tiny Mimi (random weights, the real codec's frame geometry) for the duplex tests."""

from __future__ import annotations

import pytest
from omnirt.codecs.mimi import build_mimi
from omnirt.codecs.mimi.config import MimiCodecConfig
from omnirt.codecs.mimi.reference import TINY_MIMI, random_reference_model


@pytest.fixture(scope="session")
def mimi_weights():
    model = random_reference_model(seed=5, **TINY_MIMI)
    return MimiCodecConfig.from_dict(model.config.to_dict()), model.state_dict()


@pytest.fixture
def make_mimi(mimi_weights):
    config, state = mimi_weights
    return lambda: build_mimi(config, state, num_quantizers=8)
