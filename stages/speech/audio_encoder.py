"""The thinker's audio encoder as static-shape windows, replayed from CUDA graphs.

transformers' ``Qwen3OmniMoeAudioEncoder`` cuts each audio part into chunks of ``2 * n_window``
mel frames (the last one shorter), runs three strided convolutions over every chunk, keeps each
chunk's valid positions, and runs its layers over attention *windows*: up to ``n_window_infer``
frames of one part (8 chunks, 104 tokens at real size) that never attend to each other. Its
forward derives all of that from the feature lengths with host reads (``.tolist()``, ``.item()``,
per-window splits in every layer), so it cannot be captured, and eagerly it costs a prompt about
20 ms of host launches at real size (docs/benchmarks.md).

Here the windows are the batch: a prompt's audio becomes ``W`` windows of ``K`` chunks each,
padded on the host to ``K`` chunks of ``2 * n_window`` frames (:meth:`AudioEncoder.plan`), and one
static step runs the convolutions over all ``W * K`` chunks and the layers over the ``W`` windows at
once, each window's attention restricted to its valid tokens by a key mask built on the device.
The step is captured per window-count bucket (:data:`WINDOW_BUCKETS`; more windows run in groups
of the largest), so a prompt's audio costs a replay, two uploads and a gather.

Equal to transformers' values, up to rounding (other matmul shapes; padded keys masked instead of
cut off), and not only approximately in structure: transformers pads a call's chunks to its
longest chunk, and the second and third convolutions of a partial chunk read the first's
activations past its end; the step zeroes each convolution's output past the longest chunk's
length, as that padding would be, so a call whose chunks are all shorter than ``2 * n_window``
(audio under a second) keeps transformers' values at its last tokens too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..graphs import CudaGraphRunner, upload

#: Window counts captured as CUDA graphs; a prompt with more runs in groups of the largest.
WINDOW_BUCKETS = (1, 2, 4, 8, 16)


def conv_length(frames: torch.Tensor | int) -> torch.Tensor | int:
    """Output length of one stride-2, padding-1, kernel-3 convolution over ``frames``."""
    return (frames - 1) // 2 + 1


@dataclass
class AudioPlan:
    """A prompt's audio parts as windows, on the host (:meth:`AudioEncoder.plan`)."""

    chunks: torch.Tensor  # [W, K, mel, 2 * n_window] features, each chunk zero-padded
    frames: torch.Tensor  # [W] the call's longest chunk (transformers pads every chunk to it)
    tokens: torch.Tensor  # [W] valid tokens of each window (a prefix of its K * T positions)
    index: torch.Tensor  # [N] the valid tokens' positions in the [W * K * T] grid, in order

    @property
    def windows(self) -> int:
        return int(self.chunks.shape[0])


@dataclass
class AudioCall:
    """A prompt's audio to encode, yielded by ``Thinker.forward_prompt`` as its prompt passes
    yield their pieces: the driver (``prefill.advance``) runs the calls of the prompts it reads
    at once in one :meth:`AudioEncoder.execute`, their windows as one batch."""

    owner: AudioEncoder
    plan: AudioPlan


class AudioEncoder:
    """``tower`` (a ``Qwen3OmniMoeAudioEncoder``) over static windows (see the module docstring);
    ``runner`` holds its graphs (``capture()`` at start-up with the other steps)."""

    def __init__(self, tower: nn.Module, *, graphs: bool, pool: object | None) -> None:
        self.tower = tower
        param = next(tower.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.chunk = 2 * int(tower.n_window)  # mel frames per chunk
        self.per_window = int(tower.n_window_infer) // self.chunk  # chunks per window (K)
        self.chunk_tokens = int(conv_length(conv_length(conv_length(self.chunk))))  # T
        self.mel = int(tower.config.num_mel_bins)
        self.runner = CudaGraphRunner(self._step, self._example, WINDOW_BUCKETS, enabled=graphs, pool=pool)

    @property
    def window_tokens(self) -> int:
        return self.per_window * self.chunk_tokens

    def plan(self, features: torch.Tensor, mask: torch.Tensor) -> AudioPlan:
        """The windows of ``features`` [n, mel, frames] with their ``mask`` [n, frames] (the
        processor's ``input_features`` and ``feature_attention_mask``, on the host)."""
        lengths = [int(n) for n in mask.sum(-1)]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every audio part needs at least one feature frame, got lengths {lengths}")
        k, c, t = self.per_window, self.chunk, self.chunk_tokens
        windows: list[torch.Tensor] = []
        tokens: list[int] = []
        longest = 0
        for part, length in enumerate(lengths):
            frames = features[part][:, mask[part].bool()]  # [mel, length]
            for start in range(0, length, k * c):
                piece = frames[:, start : start + k * c]
                window = piece.new_zeros((k, self.mel, c))
                count = (piece.shape[1] + c - 1) // c
                padded = F.pad(piece, (0, count * c - piece.shape[1]))
                window[:count] = padded.reshape(self.mel, count, c).permute(1, 0, 2)
                windows.append(window)
                last = piece.shape[1] - (count - 1) * c  # the last chunk's frames
                longest = max(longest, c if count > 1 else last)
                tokens.append((count - 1) * t + int(conv_length(conv_length(conv_length(last)))))
        grid = torch.arange(k * t)
        index = torch.cat([w * k * t + grid[:n] for w, n in enumerate(tokens)])
        count = len(windows)
        return AudioPlan(
            torch.stack(windows), torch.full((count,), longest), torch.tensor(tokens), index
        )

    def __call__(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The audio tokens [N, output_dim] of ``features`` / ``mask`` (see :meth:`plan`), on the
        tower's device and dtype, as ``get_audio_features(features, mask).last_hidden_state``;
        enqueued without a host sync."""
        return self.encode(self.plan(features, mask))

    def encode(self, plan: AudioPlan) -> torch.Tensor:
        return self.execute([AudioCall(self, plan)])[0]

    def execute(self, calls: list[AudioCall]) -> list[torch.Tensor]:
        """The audio tokens of each call's plan (several prompts' audio): their windows run as
        one batch, in replays of up to the largest bucket."""
        if any(c.owner is not self for c in calls):
            raise ValueError("an AudioEncoder encodes its own calls only")
        plans = [c.plan for c in calls]
        chunks = torch.cat([p.chunks for p in plans])
        frames = torch.cat([p.frames for p in plans])
        tokens = torch.cat([p.tokens for p in plans])
        group = WINDOW_BUCKETS[-1]
        outs = []
        for first in range(0, chunks.shape[0], group):
            rows = slice(first, first + group)
            inputs = {
                "chunks": upload(chunks[rows].to(self.dtype), self.device),
                "frames": upload(frames[rows], self.device),
                "tokens": upload(tokens[rows], self.device),
            }
            outs.append(self.runner(inputs)["hidden"])
        hidden = (torch.cat(outs) if len(outs) > 1 else outs[0]).flatten(0, 1)
        # Each plan's tokens, by its index shifted past the windows before it: one gather.
        grid, shift = self.window_tokens, 0
        index = []
        for plan in plans:
            index.append(plan.index + shift * grid)
            shift += plan.windows
        flat = hidden[upload(torch.cat(index), self.device)]
        return list(flat.split([int(p.index.shape[0]) for p in plans]))

    def _example(self, windows: int) -> dict[str, torch.Tensor]:
        return {
            "chunks": torch.zeros(
                (windows, self.per_window, self.mel, self.chunk), device=self.device, dtype=self.dtype
            ),
            "frames": torch.zeros(windows, dtype=torch.long, device=self.device),
            "tokens": torch.zeros(windows, dtype=torch.long, device=self.device),
        }

    def _step(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tower over ``W`` windows: ``chunks`` [W, K, mel, F], ``frames`` [W], ``tokens``
        [W] -> ``hidden`` [W, K * T, output_dim] (rows past a window's tokens are padding)."""
        tower = self.tower
        chunks, frames, tokens = inputs["chunks"], inputs["frames"], inputs["tokens"]
        w, k = chunks.shape[:2]
        x = chunks.reshape(w * k, 1, self.mel, self.chunk)
        valid = frames.repeat_interleave(k)  # [W * K]: the frames transformers pads every chunk to
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3):
            x = F.gelu(conv(x))
            valid = conv_length(valid)
            past = torch.arange(x.shape[-1], device=x.device) >= valid[:, None]  # [W * K, t]
            x = x.masked_fill(past[:, None, None, :], 0.0)  # as the padding past the call's longest
        b, c, f, t = x.shape
        x = tower.conv_out(x.permute(0, 3, 1, 2).reshape(b, t, c * f))
        x = x + tower.positional_embedding.positional_embedding[:t].to(x.dtype)
        h = x.reshape(w, k * t, -1)
        keys = torch.arange(k * t, device=h.device)[None] < tokens[:, None]
        keys[:, 0] = True  # a padding window attends to something: no NaN, and nothing reads it
        attend = keys[:, None, None, :]  # [W, 1, 1, S]
        for layer in tower.layers:
            h = self._layer(layer, h, attend)
        h = tower.proj2(tower.act(tower.proj1(tower.ln_post(h))))
        return {"hidden": h}

    @staticmethod
    def _layer(layer: nn.Module, h: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """One ``Qwen3OmniMoeAudioEncoderLayer`` over a batch of windows ``h`` [W, S, D]."""
        attn = layer.self_attn
        w, s, _ = h.shape
        x = layer.self_attn_layer_norm(h)
        q, k, v = (
            proj(x).reshape(w, s, attn.num_heads, -1).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=attn.scaling)
        h = h + attn.out_proj(out.transpose(1, 2).reshape(w, s, -1))
        h = h + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(h))))
        if h.dtype == torch.float16:
            limit = torch.finfo(h.dtype).max - 1000
            h = torch.clamp(h, min=-limit, max=limit)
        return h
