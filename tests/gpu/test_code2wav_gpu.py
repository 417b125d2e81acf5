"""Streaming code2wav at the published size on CUDA: fp32 parity with transformers' offline
decode past the sliding window, bf16, no host syncs in a step, and CUDA-graph replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnirt.codecs.code2wav import Code2WavModel, Code2WavPool, Code2WavStreamer
from omnirt.codecs.code2wav.random_init import randomize_
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FRAMES = 80  # past the 72-frame sliding window


@pytest.fixture(scope="module")
def hf():
    """The default (published) config with deterministic random weights, fp32 on the GPU,
    and TF32 off so that fp32 means fp32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with torch.device("cuda"):
        model = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig()).eval()
    yield randomize_(model, 0)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return torch.randint(0, 2048, (16, FRAMES), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def offline(hf, codes) -> np.ndarray:
    with torch.no_grad():
        return hf(codes[None].cuda())[0, 0].float().cpu().numpy()


def _stream(streamer: Code2WavStreamer, codes: torch.Tensor) -> np.ndarray:
    slot = streamer.acquire()
    chunks = [streamer.step({slot: codes[:, f]})[slot] for f in range(codes.shape[1])]
    return np.concatenate([*chunks, streamer.finish(slot)])


def _relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def test_fp32_streaming_equals_offline(hf, codes, offline) -> None:
    assert offline.shape == (FRAMES * 1920 - 555,)
    assert offline.std() > 0.01
    streamed = _stream(Code2WavStreamer(hf, max_slots=4, device="cuda"), codes)
    assert streamed.shape == offline.shape
    assert _relative_rms(streamed, offline) < 1e-4
    np.testing.assert_allclose(streamed, offline, rtol=1e-3, atol=1e-4)


def test_bf16_runs_close_to_fp32(hf, codes, offline) -> None:
    streamer = Code2WavStreamer(hf, max_slots=4, device="cuda", dtype=torch.bfloat16)
    assert streamer.model.code_embedding.weight.dtype == torch.bfloat16
    assert streamer.model.pre_transformer.inv_freq.dtype == torch.float32
    streamed = _stream(streamer, codes)
    assert streamed.shape == offline.shape and np.isfinite(streamed).all()
    assert _relative_rms(streamed, offline) < 0.25  # measured 0.05 on CPU over 4 frames


def test_step_never_syncs_with_the_host(hf, codes) -> None:
    pool = Code2WavPool(Code2WavModel.from_hf(hf), 4, device="cuda")
    step_codes = codes[:, :4].T.contiguous().cuda()
    mask = torch.tensor([True, False, True, True], device="cuda")
    pool.step_io(pool.make_inputs(4))  # first call: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.step(step_codes, mask)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replay_equals_eager(hf, codes) -> None:
    """``step_io`` captured the way ``stages/graphs.py`` does it, replayed with changing exec
    masks (sessions joining and leaving), against eager steps at the same batch size."""
    model = Code2WavModel.from_hf(hf)
    eager, graphed = Code2WavPool(model, 4, device="cuda"), Code2WavPool(model, 4, device="cuda")
    static = graphed.make_inputs(4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up with every row idle: no state moves
        for _ in range(2):
            graphed.step_io(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = graphed.step_io(static)["wav"]
    assert graphed.state["frame"].tolist() == [0, 0, 0, 0]

    masks = [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, False, True],
        [False, True, True, True],
        [True, False, True, True],
    ]
    for step, mask in enumerate(masks):
        inputs = {
            "codes": codes[:, step : step + 4].T.contiguous().cuda(),
            "exec_mask": torch.tensor(mask, device="cuda"),
        }
        expected = eager.step_io(inputs)["wav"]
        for name, tensor in inputs.items():
            static[name].copy_(tensor)
        graph.replay()
        rows = inputs["exec_mask"].nonzero().flatten()
        torch.testing.assert_close(out[rows], expected[rows], rtol=1e-5, atol=1e-6)
    assert torch.equal(eager.state["frame"], graphed.state["frame"])
