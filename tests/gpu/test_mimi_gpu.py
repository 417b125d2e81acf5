"""Mimi on CUDA at the full published config (random weights): graphs and parity.

Run on the lent GPU: ``pytest -m gpu -s tests/gpu/test_mimi_gpu.py``; results go to
docs/benchmarks.md. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from omnirt.codecs.mimi import MimiCodecConfig, MimiSlotPool, build_mimi
from omnirt.codecs.mimi.reference import random_reference_model
from omnirt.stages.codec_graphs import capture_mimi

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FRAME = 1920
LONG = 130  # frames: 260 tokens, longer than the 250-token sliding window


@pytest.fixture(scope="module")
def reference():
    model = random_reference_model(seed=0, num_quantizers=8).cuda()
    config = MimiCodecConfig.from_dict(model.config.to_dict())
    return model, config, {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.fixture
def strict_fp32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _snapshot(pool):
    return {k: v.clone() for k, v in pool.model.state_buffers().items()}


def _restore(pool, snapshot):
    for k, v in pool.model.state_buffers().items():
        v.copy_(snapshot[k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_replay_equals_eager_bitwise_per_bucket(reference, dtype):
    _, config, state = reference
    pool = MimiSlotPool(build_mimi(config, state, device="cuda", dtype=dtype), 8, buckets=[1, 8])
    capture_mimi(pool)
    assert pool.encode_runner.captured_buckets == [1, 8]
    generator = torch.Generator().manual_seed(1)
    for bucket in (1, 8):
        for _ in range(3):  # move the state away from its reset values first
            audio = (0.1 * torch.randn(bucket, FRAME, generator=generator)).cuda()
            pool.decode(pool.encode(audio))
        audio = (0.1 * torch.randn(bucket, FRAME, generator=generator)).cuda()
        run = torch.ones(bucket, dtype=torch.bool, device="cuda")
        before = _snapshot(pool)
        codes_graph = pool.encode(audio, run)
        assert pool.encode_runner.last_path == "graph"
        audio_graph = pool.decode(codes_graph, run)
        assert pool.decode_runner.last_path == "graph"
        after_graph = _snapshot(pool)
        _restore(pool, before)
        with torch.no_grad():
            codes_eager = pool.encode_runner.step({"audio": audio, "exec": run})["codes"]
            audio_eager = pool.decode_runner.step({"codes": codes_eager, "exec": run})["audio"]
        assert torch.equal(codes_graph, codes_eager)
        assert torch.equal(audio_graph, audio_eager)
        after_eager = _snapshot(pool)
        assert all(torch.equal(after_graph[k], after_eager[k]) for k in after_graph)
        print(f"\n[gpu] {dtype} bucket {bucket}: graph == eager bitwise (codes, audio, state)")


def test_full_size_streaming_equals_transformers_offline(reference, strict_fp32):
    model, config, state = reference
    pool = MimiSlotPool(build_mimi(config, state, device="cuda"), 2, buckets=[2])
    capture_mimi(pool)
    audio = (0.1 * torch.randn(2, LONG * FRAME, generator=torch.Generator().manual_seed(2))).cuda()
    with torch.no_grad():
        expected_codes = model.encode(audio[:, None], num_quantizers=8, return_dict=True).audio_codes
        expected_audio = model.decode(expected_codes, return_dict=True).audio_values[:, 0]
    codes = torch.cat([pool.encode(audio[:, i * FRAME : (i + 1) * FRAME]) for i in range(LONG)], -1)
    assert pool.encode_runner.last_path == "graph"
    mismatches = (codes != expected_codes).sum().item()
    decoded = torch.cat([pool.decode(expected_codes[:, :, i : i + 1]) for i in range(LONG)], -1)
    error = ((decoded - expected_audio).abs().max() / expected_audio.abs().max()).item()
    print(
        f"\n[gpu] full config, {LONG} frames x 2 streams, graphs fp32 (TF32 off): "
        f"code mismatches {mismatches}/{codes.numel()}, decode max error relative to peak {error:.2e}"
    )
    assert mismatches == 0
    assert error < 1e-5


def test_bf16_streaming_decode_tracks_fp32(reference):
    _, config, state = reference
    codes = torch.randint(0, 2048, (2, 8, 20), generator=torch.Generator().manual_seed(3)).cuda()
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        pool = MimiSlotPool(
            build_mimi(config, state, device="cuda", dtype=dtype), 2, buckets=[2]
        )
        capture_mimi(pool)
        outputs[dtype] = torch.cat([pool.decode(codes[:, :, i : i + 1]) for i in range(20)], -1)
    fp32, bf16 = outputs[torch.float32], outputs[torch.bfloat16]
    assert torch.isfinite(bf16).all()
    cosine = torch.nn.functional.cosine_similarity(fp32.flatten(), bf16.flatten(), dim=0).item()
    print(f"\n[gpu] bf16 vs fp32 streaming decode, 20 frames: cosine similarity {cosine:.5f}")
    assert cosine > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("tokens", "kv_heads"), [(2, 8), (1, 8), (2, 4)])
def test_triton_ring_attention_matches_torch_reference(dtype, tokens, kv_heads):
    from omnirt.kernels import ring_attention as ra

    if ra.triton is None:
        pytest.skip("Triton not installed")
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, heads, ring, dim = 5, 8, 251, 64
    q = torch.randn(rows, heads, tokens, dim, device="cuda", generator=generator).to(dtype)
    store = torch.randn(2, rows, kv_heads, ring + 1, dim, device="cuda", generator=generator).to(dtype)
    keys, values = store[0][:, :, :ring], store[1][:, :, :ring]  # strided views, as in the ring
    visible = torch.rand(rows, 1, tokens, ring, device="cuda", generator=generator) < 0.3
    visible[..., 0] = True
    bias = torch.where(visible, 0.0, -1e9).to(dtype).expand(-1, heads, -1, -1).contiguous()
    got = ra.ring_attention(q, keys, values, bias, dim**-0.5)
    assert ra.kernel_in_use().startswith("triton"), "every Triton kernel failed; torch path in use"
    expected = ra.ring_attention_torch(q.float(), keys.float(), values.float(), bias.float(), dim**-0.5)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    print(f"\n[gpu] {ra.kernel_in_use()} == torch reference ({dtype}, tokens={tokens}, kv_heads={kv_heads})")
