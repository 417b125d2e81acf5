"""A small deterministic stand-in for ``stages/duplex/lm.py``'s ``DuplexLM`` (same interface).

Each slot's output is a function of its own input codes and its frame count only, so a session
gets the same stream alone or in any batch; rows outside the exec mask keep their state. Text:
while ``talking(frame)`` a letter token (derived from the input so far), else a padding id.
Audio codes: the user's codes shifted by a running digest of the input, so the model's audio
depends on what the user said. Tokens decode with :class:`LetterTokenizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

#: Padding ids of the text stream (Moshi has two: pad and end-of-pad).
PAD, EPAD = 0, 1
VOCAB = 2 + 26


@dataclass(frozen=True)
class DuplexSampling:
    text_temperature: float = 0.7
    text_top_k: int = 25
    audio_temperature: float = 0.8
    audio_top_k: int = 250
    seed: int | None = None


GREEDY = DuplexSampling(text_temperature=0.0, audio_temperature=0.0)


@dataclass(frozen=True)
class DuplexStep:
    text: Tensor
    audio: Tensor
    audio_ready: Tensor


class LetterTokenizer:
    """Ids 2.. decode to the letters a..z; the padding ids to nothing."""

    def __len__(self) -> int:
        return VOCAB

    def decode(
        self, ids: list[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False
    ) -> str:
        return "".join(chr(ord("a") + i - 2) for i in ids if i >= 2)


def always(frame: int) -> bool:
    return True


class FakeDuplexLM:
    def __init__(
        self,
        *,
        num_codebooks: int = 8,
        codebook_size: int = 64,
        max_slots: int = 4,
        max_frames: int = 10_000,
        talking: Callable[[int], bool] = always,
    ) -> None:
        self.num_codebooks = num_codebooks
        self.codebook_size = codebook_size
        self.max_slots = max_slots
        self.max_frames = max_frames
        self.text_pad_ids = frozenset({PAD, EPAD})
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.talking = talking
        self._frames = torch.zeros(max_slots, dtype=torch.int64)
        self._digest = torch.zeros(max_slots, dtype=torch.int64)
        self._seed = torch.zeros(max_slots, dtype=torch.int64)
        self.started: list[tuple[int, DuplexSampling]] = []
        self.steps: list[int] = []  # rows of each step
        self.captured = False

    def start(self, slot: int, sampling: DuplexSampling) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range")
        self._frames[slot] = 0
        self._digest[slot] = 0
        self._seed[slot] = sampling.seed or 0
        self.started.append((slot, sampling))

    def frames(self, slot: int) -> int:
        return int(self._frames[slot])

    def capture(self) -> None:
        self.captured = True

    def step(self, user_codes: Tensor, active: Tensor) -> DuplexStep:
        rows, k = user_codes.shape
        assert k == self.num_codebooks and active.shape == (rows,) and active.dtype == torch.bool
        self.steps.append(rows)
        weights = torch.arange(1, k + 1, dtype=torch.int64)
        codes = user_codes.to(torch.int64)
        frames = self._frames[:rows]
        digest = (self._digest[:rows] * 31 + (codes * weights).sum(1) + self._seed[:rows]) % 1_000_003
        talking = torch.tensor([self.talking(int(n)) for n in frames])
        text = torch.where(talking, 2 + digest % 26, torch.where(frames % 2 == 0, PAD, EPAD))
        audio = (codes + digest[:, None] + frames[:, None]) % self.codebook_size
        ready = frames > 0
        self._digest[:rows] = torch.where(active, digest, self._digest[:rows])
        self._frames[:rows] = torch.where(active, frames + 1, frames)
        return DuplexStep(text=text, audio=audio, audio_ready=ready & active)
