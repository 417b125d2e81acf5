"""Streaming code2wav at the published size on CUDA: fp32 parity with transformers' offline
decode past the sliding window, bf16, no host syncs in a step, CUDA-graph replay through
``stages/graphs.py`` bitwise equal to eager, and the speech pipeline's vocoder on graphs.

Run on the lent GPU: ``pytest -m gpu -s tests/gpu/test_code2wav_gpu.py``; results go to
docs/benchmarks.md. Skipped without CUDA."""

from __future__ import annotations

import copy
import functools
import time

import numpy as np
import pytest
import torch
from omnirt.codecs.code2wav import Code2WavModel, Code2WavPool, Code2WavStreamer
from omnirt.codecs.code2wav.random_init import randomize_
from omnirt.stages.graphs import CudaGraphRunner
from omnirt.stages.speech.code2wav import StreamingVocoder
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


def test_fp32_steps_of_a_chunk_equal_offline(hf, codes, offline) -> None:
    """The vocoder's steps: 2 frames, then 6 at a time (past the 72-frame window), at full size."""
    streamer = Code2WavStreamer(hf, max_slots=4, device="cuda")
    slot = streamer.acquire()
    sizes = [2] + [6] * ((FRAMES - 2) // 6) + [(FRAMES - 2) % 6]
    chunks, start = [], 0
    for n in filter(None, sizes):
        chunks.append(streamer.step({slot: codes[:, start : start + n].T})[slot])
        start += n
    streamed = np.concatenate(chunks)
    assert start == FRAMES and streamed.shape == offline.shape
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
    step_codes = codes[:, :12].T.reshape(4, 3, 16).contiguous().cuda()
    counts = torch.tensor([3, 0, 1, 2], device="cuda")
    pool.step_io(pool.make_inputs(4, steps=3))  # first call: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.step(step_codes, counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _snapshot(pool: Code2WavPool) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in pool.state.items()}


def _restore(pool: Code2WavPool, snapshot: dict[str, torch.Tensor]) -> None:
    for name, tensor in pool.state.items():
        tensor.copy_(snapshot[name])


def _pad(inputs: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``inputs`` padded to ``rows`` with zeros (idle rows), as ``CudaGraphRunner`` pads them."""
    out = {}
    for name, tensor in inputs.items():
        padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        out[name] = padded
    return out


GRAPH_STEPS = 90  # slot 0 decodes every step: past the 72-frame sliding window


def _schedule():
    """``(rows, exec mask of those rows, slots joining now)`` per step: slot 0 always runs,
    slots 1-3 join (reset in place) and leave in turn; every tenth step calls with 1 row
    (bucket 1) and every tenth with 3 rows (bucket 4, one padded row)."""
    active = [True, False, False, False]
    for step in range(GRAPH_STEPS):
        joins = []
        if step % 4 == 1:
            slot = 1 + (step // 4) % 3
            active[slot] = not active[slot]
            if active[slot]:
                joins.append(slot)
        rows = {9: 1, 5: 3}.get(step % 10, 4)
        yield rows, active[:rows], joins


@pytest.mark.parametrize("steps", [1, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_replay_equals_eager_bitwise(hf, dtype, steps) -> None:
    """``pool.step_io`` of ``steps`` frames through ``stages/graphs.py``'s ``CudaGraphRunner``
    (buckets 1 and 4), with sessions joining and leaving and rows decoding 1 to ``steps`` frames:
    each replay against an eager step at the same bucket size from the same state, comparing the
    output and every state buffer bitwise."""
    pool = Code2WavPool(Code2WavModel.from_hf(hf), 4, device="cuda", dtype=dtype)
    runner = CudaGraphRunner(pool.step_io, functools.partial(pool.make_inputs, steps=steps), buckets=[1, 4])
    runner.capture()
    assert runner.captured_buckets == [1, 4]
    assert all(not tensor.any() for tensor in pool.state.values())  # warm-up and capture moved nothing

    generator = torch.Generator().manual_seed(4)
    frames = [0, 0, 0, 0]
    replays = {1: 0, 4: 0}
    graph_ms, eager_ms = [], []
    for rows, mask, joins in _schedule():
        for slot in joins:
            pool.reset(slot)
            frames[slot] = 0
        bucket = runner.bucket_for(rows)
        counts = [int(torch.randint(1, steps + 1, (), generator=generator)) * m for m in mask]
        inputs = {
            "codes": torch.randint(0, 2048, (rows, steps, 16), generator=generator).cuda(),
            "counts": torch.tensor(counts, device="cuda"),
        }
        before = _snapshot(pool)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        wav_graph = runner(inputs)["wav"]
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        assert runner.last_path == "graph"
        after_graph = _snapshot(pool)
        _restore(pool, before)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        wav_eager = pool.step_io(_pad(inputs, bucket))["wav"][:rows]
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if bucket == 4 and rows == 4:
            graph_ms.append((t1 - t0) * 1000)
            eager_ms.append((t3 - t2) * 1000)
        replays[bucket] += 1

        assert torch.equal(wav_graph, wav_eager)
        for name, tensor in pool.state.items():
            assert torch.equal(after_graph[name], tensor), name
        idle = torch.tensor([not m for m in mask] + [True] * (4 - rows), device="cuda")
        for name, tensor in pool.state.items():  # slots not stepping (or padded) kept their state
            assert torch.equal(tensor[idle], before[name][idle]), name
        for slot, n in enumerate(counts):
            frames[slot] += n
    assert pool.state["frame"].tolist() == frames
    assert frames[0] >= GRAPH_STEPS > 72
    assert wav_graph.float().std() > 0
    print(
        f"\n[gpu] code2wav {dtype}, {steps} frames a step: {GRAPH_STEPS} steps via CudaGraphRunner "
        "buckets [1, 4] "
        f"({replays[4]} replays of bucket 4, some with 3 rows padded; {replays[1]} of bucket 1), "
        f"sessions joining and leaving: graph == eager bitwise (wav and all {len(pool.state)} state "
        f"buffers), slot 0 at frame {frames[0]}; step at 4 rows: graph {np.median(graph_ms):.2f} ms, "
        f"eager {np.median(eager_ms):.2f} ms (median)"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streaming_vocoder_graphs_equal_eager_bitwise(hf, codes, offline, dtype) -> None:
    """The speech pipeline's ``StreamingVocoder``: with ``graphs`` (the CUDA default) its step
    replays a captured graph, and its PCM equals the eager steps of the same rows (``graphs=False``
    with gathering off: the padded bucket) bitwise on the same codes. The eager default gathers the
    streams with a frame, other batch shapes and so other GEMM kernels: equal within rounding."""
    module = hf if dtype == torch.float32 else copy.deepcopy(hf).to(dtype)
    streams = {"a": (0, 40), "b": (3, 25), "c": (7, 40)}  # key: (first tick, end tick)
    pcm: dict[str, dict[str, np.ndarray]] = {}
    for mode in ("graphs", "padded", "gathered"):
        graphs = mode == "graphs"
        vocoder = StreamingVocoder(module, max_streams=4, graphs=graphs)
        assert vocoder.streamer.gather is not graphs and vocoder.share_runs is graphs
        vocoder.streamer.gather = mode == "gathered"
        vocoder.share_runs = True  # the graphed runs' schedule: the same steps, so the same bits
        runners = vocoder.streamer.runners
        assert sorted(runners) == ([2, 6] if graphs else [])
        assert all(isinstance(r, CudaGraphRunner) and r.captured_buckets == [4] for r in runners.values())
        pieces: dict[str, list[np.ndarray]] = {key: [] for key in streams}
        t0 = time.perf_counter()
        for tick in range(40):
            for key, (start, end) in streams.items():
                if tick == start:
                    vocoder.open(key)
                if start <= tick < end:
                    vocoder.push(key, codes[:, tick - start])
            finishing = {key for key, (_, end) in streams.items() if tick == end - 1}
            for r in runners.values():
                r.last_path = ""
            pulled = vocoder.pull(finishing)
            for key, (chunk, _) in pulled.items():
                pieces[key].append(chunk)
            if graphs:
                assert {r.last_path for r in runners.values()} - {""} == ({"graph"} if pulled else set())
            for key in finishing:
                vocoder.close(key)
        seconds = time.perf_counter() - t0
        assert vocoder.streamer.free_slots == 4
        pcm[mode] = {key: np.concatenate(chunks) for key, chunks in pieces.items()}
        print(f"\n[gpu] StreamingVocoder {dtype} {mode}: 40 ticks, 3 streams, {seconds:.2f} s")
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for key, (start, end) in streams.items():
        assert pcm["graphs"][key].shape == ((end - start) * 1920 - 555,)
        assert np.array_equal(pcm["graphs"][key], pcm["padded"][key]), key
        gap = float(np.abs(pcm["gathered"][key] - pcm["graphs"][key]).max())
        print(f"[gpu] StreamingVocoder {dtype} {key}: gathered eager vs graphs, max |diff| {gap:.2e}")
        assert gap <= tolerance, key
    if dtype == torch.float32:
        a = pcm["graphs"]["a"]
        np.testing.assert_allclose(a, offline[: a.size], rtol=1e-3, atol=1e-4)
    print(f"\n[gpu] StreamingVocoder {dtype}: graphs == padded eager bitwise (3 streams, joining/leaving)")
