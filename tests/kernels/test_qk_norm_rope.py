"""kernels/qk_norm_rope.py on the CPU: the Triton kernel under Triton's interpreter (fp32) against
the eager chains it replaces, the eager chains against the libraries' own code, the packed-QKV and
64-bit-offset paths, the dispatcher and the custom op."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from omnirt.kernels import settings
from omnirt.kernels.qk_norm_rope import (
    kernel_applies,
    qk_norm_rope,
    qk_norm_rope_reference,
    qk_norm_rope_to_cache,
    qk_norm_rope_triton,
    split_packed_qkv,
    table_from_complex,
    table_from_halves,
    table_from_interleaved,
    to_cache_applies,
)
from omnirt.kernels.w8a8 import quantize_scaled

from . import sm90
from .conftest import interpreted

# (per_head, norm, rope, interleaved): every chain the models use, and the other combinations
CHAINS = [
    (True, "composite", "io", False),  # Qwen3 (transformers)
    (True, "composite", "complex", True),  # Z-Image
    (False, "fused", "float32", True),  # Wan
    (False, "fused", "io", True),  # Wan with tables cast to the model dtype
    (True, "composite", "float32", False),
    (False, "composite", "io", False),
    (True, "fused", "float32", True),
]


def _inputs(batch=2, tokens=5, hq=4, hk=2, dim=64, per_head=True, table_batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, hq, dim, generator=g) * 3
    k = torch.randn(batch, tokens, hk, dim, generator=g)
    qw = torch.randn(dim if per_head else hq * dim, generator=g)
    kw = torch.randn(dim if per_head else hk * dim, generator=g)
    angles = torch.rand(table_batch, tokens, dim // 2, generator=g) * 50
    return q, k, qw, kw, torch.cat([angles.cos(), angles.sin()], dim=-1)


def _close(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("preset", ["exact", "fast"])
@pytest.mark.parametrize("chain", CHAINS, ids=["-".join(map(str, c)) for c in CHAINS])
def test_kernel_matches_the_eager_chain(chain, preset):
    per_head, norm, rope, interleaved = chain
    kw = dict(eps=1e-6, interleaved=interleaved, per_head=per_head, norm=norm, rope=rope)
    for shape in (dict(dim=64), dict(batch=1, tokens=9, hq=3, hk=1, dim=128)):  # GQA, odd heads, 128
        q, k, qw, kw_, table = _inputs(per_head=per_head, **shape)
        got = qk_norm_rope_triton(q, k, qw, kw_, table, preset=preset, **kw)
        _close(got, qk_norm_rope_reference(q, k, qw, kw_, table, **kw))


@interpreted
@pytest.mark.parametrize(
    "order",
    ["lanes", "vec4", "lanes_halving", "vec4_halving", "vec4_warp", "vec4_lanes"],
)
def test_every_summation_order_is_a_sum_of_squares(order):
    # the orders differ in the last bits only (the GPU numerics pick one); each is the right sum
    q, k, qw, kw, table = _inputs(batch=2, tokens=6, hq=4, hk=4, dim=128)
    args = dict(eps=1e-6, interleaved=False)
    got = qk_norm_rope_triton(q, k, qw, kw, table, composite_sum=order, **args)
    _close(got, qk_norm_rope_reference(q, k, qw, kw, table, **args))


@interpreted
def test_lane_reads_move_the_same_sums(monkeypatch):
    """``vec4_lanes`` reads and writes each head at offsets known contiguous in runs of 4 only, and
    sums the lanes as ``vec4_warp`` does (Triton's reduction): the same bits, for separate outputs
    and for the decode step's cache writes; the layouts differ on the GPU only."""
    q, k, qw, kw, table = _inputs(batch=3, tokens=1, hq=4, hk=2, dim=128)
    args = dict(eps=1e-6, interleaved=False)
    lanes = qk_norm_rope_triton(q, k, qw, kw, table, composite_sum="vec4_lanes", **args)
    warp = qk_norm_rope_triton(q, k, qw, kw, table, composite_sum="vec4_warp", **args)
    assert torch.equal(lanes[0], warp[0]) and torch.equal(lanes[1], warp[1])
    g = torch.Generator().manual_seed(9)
    v = torch.randn(3, 1, 2, 128, generator=g)
    at = torch.tensor([2, 0, 5])
    written = []
    for order in ("vec4_lanes", "vec4_warp"):
        monkeypatch.setattr(importlib.import_module(qk_norm_rope.__module__), "COMPOSITE_SUM", order)
        caches = [torch.zeros(3, 2, 6, 128) for _ in range(2)]
        written.append((qk_norm_rope_to_cache(q, k, v, qw, kw, table, *caches, at, **args), *caches))
    assert all(torch.equal(a, b) for a, b in zip(*written, strict=True))
    assert torch.equal(written[0][1][torch.arange(3), :, at], warp[1][:, 0])


def _butterflies(ptx: str) -> list[int]:
    return [int(n) for n in re.findall(r"shfl\.sync\.bfly\.b32\s+\S+,\s*\S+,\s*(\d+)", ptx)]


def _bf16_launch(call) -> tuple[str, str, dict]:
    """The one kernel launch ``call`` makes, its heads, weights and caches typed bf16 (the
    interpreter runs fp32; the GPU's dtype decides the vector widths)."""
    with sm90.capture() as captured:
        call()
    (launch,) = captured
    for name in ("Q", "K", "QO", "KO", "QW", "KW", "V", "VO"):
        launch[2]["signature"][name] = "*bf16"
    return launch


@interpreted
def test_lane_reads_compile_to_the_halving_tree(monkeypatch):
    """What makes ``vec4_lanes`` ATen's order on the GPU, read off the compiler (sm_90, bf16, each
    launch specialised as the GPU's): each head's 32 lane sums meet in the warp's butterfly alone,
    lane ``i`` with ``i + 16`` first, in every reduction of the kernel: Z-Image's heads, and the
    speech decode step's Qwen3 heads written to the caches (whose value copy must read at the same
    widths: Triton gives one shape's memory ops the widest vectors among them). ``vec4_warp``'s
    loads give a thread two adjacent lanes, added first, so its butterfly starts at 8 (its 1-49
    elements in millions off)."""
    q, k, qw, kw, _ = _inputs(batch=1, tokens=16, hq=30, hk=30, dim=128)
    table = table_from_complex(torch.polar(torch.ones(1, 16, 64), torch.randn(1, 16, 64)))
    qkv = torch.randn(8, 1, (32 + 2 * 4) * 128)
    dq, dk, dv = split_packed_qkv(qkv, 32, 4, 128)
    _, _, dqw, dkw, dtable = _inputs(batch=8, tokens=1, hq=32, hk=4, dim=128)
    caches = [torch.zeros(9, 4, 33, 128) for _ in range(2)]
    launches = []
    for order in ("vec4_lanes", "vec4_warp"):
        launches.append(_bf16_launch(lambda order=order: qk_norm_rope_triton(
            q, k, qw, kw, table, eps=1e-6, interleaved=True, rope="complex", composite_sum=order
        )))  # fmt: skip
        monkeypatch.setattr(importlib.import_module(qk_norm_rope.__module__), "COMPOSITE_SUM", order)
        launches.append(_bf16_launch(lambda: qk_norm_rope_to_cache(
            dq, dk, dv, dqw, dkw, dtable, *caches, torch.arange(8), eps=1e-6, interleaved=False
        )))  # fmt: skip
    for name, compiled in zip(["zimage lanes", "decode lanes", "zimage warp", "decode warp"],
                              sm90.assembly(launches), strict=True):  # fmt: skip
        trees = _butterflies(compiled["ptx"])
        if "lanes" in name:
            assert trees and trees == [16, 8, 4, 2, 1] * (len(trees) // 5), (name, trees)
        else:
            assert trees[:4] == [8, 4, 2, 1] and 16 not in trees, (name, trees)


@interpreted
def test_per_batch_tables_and_no_weights():
    q, k, _, _, table = _inputs(table_batch=2)
    kw = dict(eps=1e-5, interleaved=True, rope="complex")
    _close(
        qk_norm_rope_triton(q, k, None, None, table, **kw),
        qk_norm_rope_reference(q, k, None, None, table, **kw),
    )


@interpreted
def test_packed_qkv_is_read_in_place():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 7, (8 + 2 * 2) * 64, generator=g)
    q, k, v = split_packed_qkv(qkv, 8, 2, 64)
    assert q.data_ptr() == qkv.data_ptr() and not q.is_contiguous()
    assert torch.equal(v, qkv[..., 640:].unflatten(-1, (2, 64)))
    _, _, qw, kw, table = _inputs(batch=2, tokens=7, hq=8, hk=2, dim=64, per_head=False)
    args = dict(eps=1e-6, interleaved=True, per_head=False, norm="fused", rope="float32")
    packed = qk_norm_rope_triton(q, k, qw, kw, table, **args)
    separate = qk_norm_rope_triton(q.contiguous(), k.contiguous(), qw, kw, table, **args)
    for a, b in zip(packed, separate, strict=True):
        assert torch.equal(a, b)
    _close(packed, qk_norm_rope_reference(q, k, qw, kw, table, **args))
    with pytest.raises(ValueError, match="features"):
        split_packed_qkv(qkv, 8, 3, 64)


@interpreted
@pytest.mark.parametrize("rope", ["float32", "io"])
def test_output_from_held_vectors_has_the_reloaded_bits(rope):
    """``output_from="held"`` (the exact fused norm over all heads, interleaved pairs) writes each
    token from the vectors its statistic read: bitwise the head tiles read again, for separate and
    packed inputs, grouped keys, tokens past one 512-element step and not whole steps (masked),
    with and without weights."""
    g = torch.Generator().manual_seed(9)
    args = dict(eps=1e-6, interleaved=True, per_head=False, norm="fused", rope=rope)
    for hq, hk, dim in ((12, 12, 128), (6, 2, 64), (5, 3, 128)):
        qkv = torch.randn(2, 3, (hq + 2 * hk) * dim, generator=g) * 2
        packed = split_packed_qkv(qkv, hq, hk, dim)[:2]
        _, _, qw, kw, table = _inputs(batch=2, tokens=3, hq=hq, hk=hk, dim=dim, per_head=False, seed=hq)
        for q, k in (packed, (packed[0].contiguous(), packed[1].contiguous())):
            for weights in ((qw, kw), (None, None)):
                held = qk_norm_rope_triton(q, k, *weights, table, output_from="held", **args)
                reload = qk_norm_rope_triton(q, k, *weights, table, output_from="reload", **args)
                for a, b in zip(held, reload, strict=True):
                    assert torch.equal(a, b), (hq, hk, dim)
                _close(held, qk_norm_rope_reference(q, k, *weights, table, **args))
    # several tokens a program (2 x 3 tokens: the last program's tokens past the end masked)
    for q, k in (packed, (packed[0].contiguous(), packed[1].contiguous())):
        held = dict(output_from="held", **args)
        one = qk_norm_rope_triton(q, k, qw, kw, table, tokens_per_program=1, **held)
        for count in (2, 4):
            got = qk_norm_rope_triton(q, k, qw, kw, table, tokens_per_program=count, **held)
            assert all(torch.equal(a, b) for a, b in zip(got, one, strict=True)), count
    with pytest.raises(ValueError, match="tokens_per_program must be"):
        qk_norm_rope_triton(q, k, None, None, table, output_from="held", tokens_per_program=3, **args)
    with pytest.raises(ValueError, match="output_from must be one of"):
        qk_norm_rope_triton(q, k, None, None, table, output_from="twice", **args)


@interpreted
@pytest.mark.parametrize("chain", CHAINS, ids=["-".join(map(str, c)) for c in CHAINS])
def test_static_head_loop_has_the_runtime_loops_bits(chain):
    """``head_loop="static"`` (every head tile loaded before the first is normed) writes the same
    bits as the runtime loop: two tiles with the last one part masked, one tile part masked, packed
    and separate inputs; grouped keys keep the runtime loop."""
    per_head, norm, rope, interleaved = chain
    args = dict(eps=1e-6, interleaved=interleaved, per_head=per_head, norm=norm, rope=rope)
    g = torch.Generator().manual_seed(11)
    for hq, hk, dim in ((40, 40, 64), (3, 3, 128), (6, 2, 64)):
        qkv = torch.randn(2, 3, (hq + 2 * hk) * dim, generator=g) * 2
        packed = split_packed_qkv(qkv, hq, hk, dim)[:2]
        _, _, qw, kw, table = _inputs(batch=2, tokens=3, hq=hq, hk=hk, dim=dim, per_head=per_head, seed=hq)
        for q, k in (packed, (packed[0].contiguous(), packed[1].contiguous())):
            for preset in ("exact", "fast"):
                static = qk_norm_rope_triton(q, k, qw, kw, table, preset=preset, head_loop="static", **args)
                runtime = qk_norm_rope_triton(q, k, qw, kw, table, preset=preset, head_loop="runtime", **args)
                assert all(torch.equal(a, b) for a, b in zip(static, runtime, strict=True)), (hq, hk, preset)
        _close(static, qk_norm_rope_reference(q, k, qw, kw, table, **args))
    with pytest.raises(ValueError, match="head_loop must be one of"):
        qk_norm_rope_triton(q, k, qw, kw, table, head_loop="unrolled", **args)


@interpreted
@pytest.mark.parametrize("chain", CHAINS, ids=["-".join(map(str, c)) for c in CHAINS])
def test_quantized_outputs_are_the_rounded_outputs_over_their_scales(chain):
    """``out_scales``: the outputs stored as 8-bit values over fixed scales are bitwise the
    unquantized kernel's outputs quantized over them (int8 here: the interpreter has no fp8), on
    the runtime and static head loops and the held rows, with values past the scale's range
    clamped."""
    per_head, norm, rope, interleaved = chain
    args = dict(eps=1e-6, interleaved=interleaved, per_head=per_head, norm=norm, rope=rope)
    for hq, hk, dim in ((12, 12, 64), (5, 3, 128)):
        q, k, qw, kw, table = _inputs(batch=2, tokens=3, hq=hq, hk=hk, dim=dim, per_head=per_head, seed=hq)
        scales = (torch.tensor([0.02]), torch.tensor([0.004]))  # k's small: some of its values clamp
        for preset in ("exact", "fast"):
            for variant in ({}, {"head_loop": "static"}, {"output_from": "reload"}):
                plain = qk_norm_rope_triton(q, k, qw, kw, table, preset=preset, **variant, **args)
                got = qk_norm_rope_triton(
                    q, k, qw, kw, table, preset=preset, out_scales=scales, out_kind="int8", **variant, **args
                )
                for g, p, scale in zip(got, plain, scales, strict=True):
                    assert g.dtype == torch.int8 and torch.equal(g, quantize_scaled(p, scale, "int8"))
        assert (got[1].abs() == 127).any() and (got[0].abs() < 127).any()
    with pytest.raises(ValueError, match="quantized outputs do not go into a cache"):
        _launch = importlib.import_module("omnirt.kernels.qk_norm_rope")._launch
        v = torch.zeros(1, 1, 2, 64)
        _launch(q[:1, :1], k[:1, :1], qw, kw, table, 1e-6, interleaved, per_head, norm, rope, "exact",
                cache=(v, v, v, torch.zeros(1)), out_scales=scales)  # fmt: skip


def test_quantized_dispatcher_runs_the_eager_chain_off_cuda():
    q, k, qw, kw, table = _inputs()
    args = dict(eps=1e-6, interleaved=False)
    scales = (torch.tensor([0.03]), torch.tensor([0.01]))
    got = qk_norm_rope(q, k, qw, kw, table, out_scales=scales, **args)
    want = qk_norm_rope_reference(q, k, qw, kw, table, **args)
    for g, w, scale in zip(got, want, scales, strict=True):
        assert g.dtype == torch.float8_e4m3fn
        assert torch.equal(g.view(torch.int8), quantize_scaled(w, scale, "fp8").view(torch.int8))


@interpreted
def test_offsets_past_two_to_the_31(monkeypatch):
    """A token 2^31 elements into its storage (packed QKV of 75,600 tokens with CFG batch 2 is
    past that): 32-bit offsets would wrap, which the interpreter reproduces."""
    from triton.runtime import interpreter

    # After a launch the interpreter copies each argument's storage back onto itself (a no-op for
    # CPU tensors) and would touch all 8 GiB of this mostly unused one.
    monkeypatch.setattr(interpreter.GridExecutor, "_restore_args_dev", lambda *args, **kwargs: None)
    dim = 16
    big = torch.empty(2**31 + 2 * dim, dtype=torch.float32)  # 8 GiB of address space, two rows used
    q = big.as_strided((1, 2, 1, dim), (0, 2**31, dim, 1))
    g = torch.Generator().manual_seed(5)
    q[0, 0, 0] = torch.randn(dim, generator=g)
    q[0, 1, 0] = torch.randn(dim, generator=g) * 5
    k = torch.randn(1, 2, 1, dim, generator=g)
    angles = torch.rand(1, 2, dim // 2, generator=g)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    args = dict(eps=1e-6, interleaved=False)
    got = qk_norm_rope_triton(q, k, None, None, table, **args)
    _close(got, qk_norm_rope_reference(q, k, None, None, table, **args))
    # Wan's chain, each token read once (``output_from="held"``)
    args = dict(eps=1e-6, interleaved=True, per_head=False, norm="fused", rope="float32")
    got = qk_norm_rope_triton(q, k, None, None, table, output_from="held", **args)
    _close(got, qk_norm_rope_reference(q, k, None, None, table, **args))


@interpreted
def test_unsupported_inputs_are_refused_by_the_kernel():
    q, k, qw, kw, table = _inputs()
    args = dict(eps=1e-6, interleaved=True)
    with pytest.raises(ValueError, match="head dim"):
        qk_norm_rope_triton(q[..., :48], k[..., :48], None, None, table[..., :48], **args)
    with pytest.raises(ValueError, match="weights"):
        qk_norm_rope_triton(q, k, qw[:10], kw, table, **args)
    with pytest.raises(ValueError, match="table"):
        qk_norm_rope_triton(q, k, qw, kw, table[:, :3], **args)
    with pytest.raises(ValueError, match="interleaved"):
        qk_norm_rope_triton(q, k, qw, kw, table, eps=1e-6, interleaved=False, rope="complex")
    with pytest.raises(ValueError, match="preset"):
        qk_norm_rope_triton(q, k, qw, kw, table, preset="quick", **args)


def test_the_eager_chains_are_the_libraries_code():
    """The reference is what the models compute: transformers' Qwen3 norm and rotary, and (through
    the fused processors, on the CPU) diffusers' Z-Image and Wan attention (tests/diffusion)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerTextRMSNorm,
        apply_rotary_pos_emb,
    )

    for dtype in (torch.float32, torch.bfloat16):
        q, k, _, _, _ = _inputs(batch=2, tokens=6, hq=4, hk=2, dim=64)
        q, k = q.to(dtype), k.to(dtype)
        norm_q, norm_k = (
            Qwen3OmniMoeThinkerTextRMSNorm(64, eps=1e-6),
            Qwen3OmniMoeThinkerTextRMSNorm(64, eps=1e-6),
        )
        with torch.no_grad():
            norm_q.weight.normal_()
            norm_k.weight.normal_()
        norm_q, norm_k = norm_q.to(dtype), norm_k.to(dtype)
        freqs = torch.rand(2, 6, 32) * 20
        cos, sin = (
            torch.cat([freqs, freqs], -1).cos().to(dtype),
            torch.cat([freqs, freqs], -1).sin().to(dtype),
        )
        with torch.no_grad():
            want = apply_rotary_pos_emb(norm_q(q).transpose(1, 2), norm_k(k).transpose(1, 2), cos, sin)
            got = qk_norm_rope_reference(
                q, k, norm_q.weight, norm_k.weight, table_from_halves(cos, sin), eps=1e-6, interleaved=False
            )
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w.transpose(1, 2))


def test_table_builders():
    cos = torch.rand(1, 3, 8)
    sin = torch.rand(1, 3, 8)
    assert torch.equal(
        table_from_halves(torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)), torch.cat([cos, sin], -1)
    )
    wan_cos = cos.repeat_interleave(2, dim=-1).unsqueeze(2)  # Wan: [1, T, 1, D], each frequency twice
    wan_sin = sin.repeat_interleave(2, dim=-1).unsqueeze(2)
    assert torch.equal(table_from_interleaved(wan_cos, wan_sin), torch.cat([cos, sin], -1))
    assert torch.equal(table_from_complex(torch.complex(cos, sin)), torch.cat([cos, sin], -1))


def test_dispatcher_runs_the_eager_chain_off_cuda():
    q, k, qw, kw, table = _inputs()
    args = dict(eps=1e-6, interleaved=False)
    assert not kernel_applies(q, k, qw, kw, table)
    got = qk_norm_rope(q, k, qw, kw, table, **args)
    for a, b in zip(got, qk_norm_rope_reference(q, k, qw, kw, table, **args), strict=True):
        assert torch.equal(a, b)


def test_fused_setting():
    before = settings.FUSED
    try:
        for value in ("on", "off", "auto"):
            settings.set_fused(value)
            assert settings.FUSED == value
        assert settings.wanted(True) and not settings.wanted(False)
        with pytest.raises(ValueError, match="auto, on, off"):
            settings.set_fused("sometimes")
    finally:
        settings.set_fused(before)


@interpreted
def test_custom_op_schema_fake_and_kernel():
    q, k, qw, kw, table = _inputs(batch=1, tokens=3, hq=2, hk=2, dim=32)
    args = (q, k, qw, kw, table, 1e-6, True, True, "composite", "complex", "exact")
    torch.library.opcheck(
        torch.ops.omnirt.qk_norm_rope.default, args, test_utils=("test_schema", "test_faketensor")
    )
    got = torch.ops.omnirt.qk_norm_rope(*args)
    _close(got, qk_norm_rope_reference(q, k, qw, kw, table, eps=1e-6, interleaved=True, rope="complex"))
    scales = (torch.tensor([0.05]), torch.tensor([0.05]))
    quantized = (*args, *scales, "int8")
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.omnirt.qk_norm_rope.default, quantized, test_utils=checks)
    got = torch.ops.omnirt.qk_norm_rope(*quantized)
    assert all(g.dtype == torch.int8 for g in got)


@interpreted
def test_to_cache_writes_what_the_unfused_call_and_assignments_write():
    """A decode step's keys and values land in each row's entry of the caches (idle rows' entry the
    scratch column), from packed QKV views; the queries and the keys are the kernel's own bits and
    nothing else of the caches moves."""
    g = torch.Generator().manual_seed(7)
    batch, hq, hk, dim, entries = 3, 4, 2, 64, 9
    qkv = torch.randn(batch, 1, (hq + 2 * hk) * dim, generator=g)
    q, k, v = split_packed_qkv(qkv, hq, hk, dim)
    _, _, qw, kw, table = _inputs(batch=batch, tokens=1, hq=hq, hk=hk, dim=dim)
    caches = [torch.randn(batch + 2, hk, entries + 1, dim, generator=g) for _ in range(2)]
    before = [c.clone() for c in caches]
    at = torch.tensor([4, 0, entries])  # the last row idle: its scratch column
    args = dict(eps=1e-6, interleaved=False)
    got_q = qk_norm_rope_to_cache(q, k, v, qw, kw, table, *caches, at, **args)
    want_q, want_k = qk_norm_rope_triton(q, k, qw, kw, table, **args)
    rows = torch.arange(batch)
    before[0][rows, :, at] = want_k[:, 0]
    before[1][rows, :, at] = v[:, 0]
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
    # the custom op (what torch.compile traces) declares the caches it writes
    op_args = (q, k, v, qw, kw, table, *caches, at, 1e-6, False, "composite", "io", "exact")
    torch.library.opcheck(
        torch.ops.omnirt.qk_norm_rope_to_cache.default, op_args, test_utils=("test_schema", "test_faketensor")
    )


@interpreted
def test_to_cache_refuses_what_it_cannot_write():
    g = torch.Generator().manual_seed(8)
    q, k, qw, kw, table = _inputs(batch=2, tokens=1, hq=4, hk=2, dim=64)
    v = torch.randn(k.shape, generator=g)
    cache = torch.zeros(2, 2, 5, 64)
    at = torch.tensor([0, 1])
    args = dict(eps=1e-6, interleaved=False)
    q2, k2, qw2, kw2, table2 = _inputs(batch=2, tokens=2, hq=4, hk=2, dim=64)
    with pytest.raises(ValueError, match="one token per row"):
        qk_norm_rope_to_cache(q2, k2, k2, qw2, kw2, table2, cache, cache, at, **args)
    with pytest.raises(ValueError, match="caches must be"):
        qk_norm_rope_to_cache(q, k, v, qw, kw, table, cache.half(), cache, at, **args)
    with pytest.raises(ValueError, match="caches must be"):
        qk_norm_rope_to_cache(q, k, v, qw, kw, table, cache[:, :1], cache, at, **args)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope_to_cache(q, k, v, qw, kw, table, cache, cache, at[:1], **args)
    with pytest.raises(ValueError, match="v must be"):
        qk_norm_rope_to_cache(q, k, v[..., :1, :], qw, kw, table, cache, cache, at, **args)
    # never from a dispatcher on CPU tensors
    assert not to_cache_applies(q, k, v, qw, kw, table, cache, cache, at)
