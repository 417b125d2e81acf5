"""Streaming convolutions against whole-sequence torch convolutions, chunk by chunk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnirt.codecs.mimi.conv import StreamingConv1d, StreamingConvTranspose1d

pytestmark = pytest.mark.usefixtures("no_grad")

ROWS = 2


@pytest.fixture
def no_grad():
    with torch.no_grad():
        yield


def _chunks(total: int, sizes: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    assert start == total
    return bounds


@pytest.mark.parametrize(
    ("kernel", "stride", "dilation", "pad_mode"),
    [
        (7, 1, 1, "constant"),
        (3, 1, 2, "constant"),
        (8, 4, 1, "constant"),
        (4, 2, 1, "replicate"),
        (1, 1, 1, "constant"),
    ],
)
def test_causal_conv_in_chunks_equals_whole_sequence(kernel, stride, dilation, pad_mode):
    torch.manual_seed(0)
    conv = StreamingConv1d(3, 5, kernel, stride, dilation, pad_mode=pad_mode).eval()
    conv.alloc_state(ROWS, torch.device("cpu"), torch.float32)
    x = torch.randn(ROWS, 3, 12 * stride)
    context = (kernel - 1) * dilation + 1 - stride
    padded = F.pad(x, (context, 0), mode="replicate" if pad_mode == "replicate" else "constant")
    expected = F.conv1d(padded, conv.conv.weight, conv.conv.bias, stride, 0, dilation)
    run = torch.ones(ROWS, dtype=torch.bool)
    pieces = [
        conv(x[..., a:b], run) for a, b in _chunks(x.shape[-1], [stride, 5 * stride, 2 * stride, 4 * stride])
    ]
    torch.testing.assert_close(torch.cat(pieces, -1), expected, rtol=1e-5, atol=1e-6)


def test_chunk_not_a_multiple_of_the_stride_is_refused():
    conv = StreamingConv1d(3, 5, 8, 4)
    conv.alloc_state(ROWS, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="multiple of the stride"):
        conv(torch.zeros(ROWS, 3, 6), torch.ones(ROWS, dtype=torch.bool))


@pytest.mark.parametrize(
    ("channels_in", "channels_out", "kernel", "stride", "groups"),
    [(4, 3, 8, 4, 1), (4, 4, 4, 2, 4), (4, 6, 6, 2, 2), (4, 3, 5, 2, 1)],
    ids=["dense", "depthwise", "grouped", "kernel-not-multiple"],
)
def test_transposed_conv_in_chunks_equals_whole_sequence(channels_in, channels_out, kernel, stride, groups):
    torch.manual_seed(1)
    conv = StreamingConvTranspose1d(channels_in, channels_out, kernel, stride, groups=groups).eval()
    conv.alloc_state(ROWS, torch.device("cpu"), torch.float32)
    x = torch.randn(ROWS, channels_in, 9)
    full = F.conv_transpose1d(x, conv.conv.weight, conv.conv.bias, stride, groups=groups)
    expected = full[..., : 9 * stride]  # causal: everything trimmed on the right
    run = torch.ones(ROWS, dtype=torch.bool)
    pieces = [conv(x[..., a:b], run) for a, b in _chunks(9, [1, 3, 1, 4])]
    torch.testing.assert_close(torch.cat(pieces, -1), expected, rtol=1e-5, atol=1e-6)


def test_idle_rows_do_not_move_conv_state():
    conv = StreamingConvTranspose1d(2, 2, 4, 2).eval()
    conv.alloc_state(ROWS, torch.device("cpu"), torch.float32)
    run = torch.tensor([True, False])
    conv(torch.randn(ROWS, 2, 3), run)
    tail = conv.state_buffers()["tail"]
    assert tail[0].abs().sum() > 0 and torch.count_nonzero(tail[1]) == 0
