"""Convolutions with their bias and residual in cuDNN's epilogue (``kernels/cudnn_conv.py``) on the
CPU: the reference's numerics, the dispatcher off CUDA, bad arguments, and the cuDNN graph as far
as the front end builds it without a GPU. tests/gpu/test_wan_vae_gpu.py runs the graphs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from omnirt.kernels import cudnn_conv


def _frames(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spatial", [2, 3])
def test_the_reference_adds_in_fp32_and_rounds_once(spatial):
    x = _frames(2, 8, *([6] * spatial)).to(torch.bfloat16)
    w = (_frames(5, 8, *([3] * spatial), seed=1) * 0.2).to(torch.bfloat16)
    bias = _frames(5, seed=2).to(torch.bfloat16)
    padding = (1,) * spatial
    shape = cudnn_conv.out_shape(x, w, padding)
    assert shape == (2, 5, *([6] * spatial))
    r1, r2 = _frames(*shape, seed=3).to(torch.bfloat16), _frames(*shape, seed=4).to(torch.bfloat16)
    got = cudnn_conv.conv_epilogue_reference(x, w, padding, bias=bias, addends=(r1, r2))
    conv = F.conv3d if spatial == 3 else F.conv2d
    want = conv(x.double(), w.double(), bias.double(), padding=padding) + r1.double() + r2.double()
    assert got.dtype == torch.bfloat16
    # rounded once: within half a bf16 ulp of the exact sum (up to fp32's own error)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(2**-20)
    assert ((got.double() - want).abs() <= ulp * 0.5 + 1e-5).all()
    # the exact level's chain rounds three times: it differs somewhere
    chain = (conv(x, w, padding=padding) + bias.view(1, -1, *([1] * spatial))) + r1 + r2
    assert not torch.equal(chain, got)


def test_off_cuda_it_does_not_apply_and_refuses():
    x = _frames(1, 4, 3, 6, 6).contiguous(memory_format=torch.channels_last_3d)
    w = _frames(4, 4, 3, 3, 3).contiguous(memory_format=torch.channels_last_3d)
    assert not cudnn_conv.supported(x, w)
    assert not cudnn_conv.applies(x, w, (0, 0, 0))
    assert cudnn_conv.conv_graph(x, w, (0, 0, 0)) is None  # the caller runs ATen's
    with pytest.raises(ValueError, match="padding"):
        cudnn_conv.conv_graph(x, w, (0, 0))
    with pytest.raises(RuntimeError, match="does not apply"):
        cudnn_conv.conv_epilogue(x, w, (0, 0, 0))
    with pytest.raises(ValueError, match="padding"):
        cudnn_conv.conv_epilogue(x, w, (0, 0))
    with pytest.raises(ValueError, match="input channels"):
        cudnn_conv.conv_epilogue(x, w[:, :2], (0, 0, 0))


def test_only_channels_last_addends_are_offered():
    """cuDNN's fused epilogues decline addends that are not dense channels-last (on the H100), so
    such addends are not offered: an upsampler's frames-first output, NCDHW, another dtype."""
    x = torch.empty(1, 8, 4, 6, 6, device="meta", memory_format=torch.channels_last_3d)
    w = torch.empty(8, 8, 3, 3, 3, device="meta", memory_format=torch.channels_last_3d)
    out = (1, 8, 2, 4, 4)
    dense = torch.empty(out, device="meta", memory_format=torch.channels_last_3d)
    frames_first = torch.empty(1, 2, 8, 4, 4, device="meta").transpose(1, 2)
    assert cudnn_conv._addends_fit(x, w, (0, 0, 0), (dense, dense))
    assert cudnn_conv._addends_fit(x, w, (0, 0, 0), ())
    assert not cudnn_conv._addends_fit(x, w, (0, 0, 0), (dense, frames_first))
    assert not cudnn_conv._addends_fit(x, w, (0, 0, 0), (torch.empty(out, device="meta"),))
    assert not cudnn_conv._addends_fit(x, w, (0, 0, 0), (dense.to(torch.float16),))
    assert not cudnn_conv._addends_fit(x, w, (1, 1, 1), (dense,))  # not the output's shape


@pytest.mark.parametrize("dims", [(1, 96, 4, 8, 10), (2, 3, 1, 7, 5), (3, 16, 9, 11), (1, 1, 1, 1)])
def test_the_output_strides_are_torchs_channels_last(dims):
    """The graph's output strides, computed without a tensor, are torch's channels-last ones."""
    fmt = torch.channels_last_3d if len(dims) == 5 else torch.channels_last
    want = torch.empty(dims, device="meta", memory_format=fmt).stride()
    assert cudnn_conv._channels_last_strides(dims) == want


def test_the_cudnn_graph_is_built():
    """The convolution, its bias and each addend as pointwise nodes after it, the output in the
    frames' dtype and channels-last strides."""
    try:
        import cudnn
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("nvidia-cudnn-frontend is not installed (the cudnn extra)")
    x = torch.empty(1, 96, 6, 10, 12, device="meta", memory_format=torch.channels_last_3d)
    w = torch.empty(96, 96, 3, 3, 3, device="meta", memory_format=torch.channels_last_3d)
    out = torch.empty(1, 96, 4, 8, 10, device="meta", memory_format=torch.channels_last_3d)
    frames_first = torch.empty(1, 4, 96, 8, 10, device="meta").transpose(1, 2)  # an upsampler's view
    for bias, addends in ((False, ()), (True, (frames_first,)), (True, (out, frames_first))):
        shape = cudnn_conv._Shape(
            tuple(x.shape), tuple(x.stride()), tuple(w.shape), tuple(w.stride()), (0, 0, 0), bias,
            tuple(tuple(a.stride()) for a in addends), tuple(out.stride()), torch.bfloat16, 0,
        )  # fmt: skip
        graph = cudnn_conv.build_graph(cudnn, shape)
        kinds = [node.node_type for node in graph.nodes]
        assert kinds == [cudnn.NodeType.CONV_FPROP] + [cudnn.NodeType.POINTWISE] * (bias + len(addends))
        assert graph.nodes[0].params == {"padding": [0, 0, 0], "stride": [1, 1, 1], "dilation": [1, 1, 1]}
        modes = [node.params["mode"] for node in graph.nodes[1:]]
        assert modes == ["bias"] * bias + ["add"] * len(addends)
        tensors = {t.uid: t for t in graph.tensors.values() if not t.is_virtual}
        y = tensors[cudnn_conv._Y]
        assert list(y.dim) == list(out.shape) and list(y.stride) == list(out.stride())
        assert y.data_type == cudnn.data_type.BFLOAT16
        for i, addend in enumerate(addends):
            assert list(tensors[cudnn_conv._ADDEND + i].stride) == list(addend.stride())
        assert len(tensors) == 3 + bias + len(addends)
