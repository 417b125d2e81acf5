"""Exact streaming Qwen3-Omni code2wav (codec codes -> 24 kHz PCM), batched across sessions.

transformers' ``Qwen3OmniMoeCode2Wav`` decodes a whole sequence of frames at once and keeps no
state. This package decodes one or more frames (``num_quantizers`` codes each) per stream per
step, with O(1) work per frame and explicit per-stream state (sliding-window K/V rings, the tails of every
causal and transposed convolution), and its output equals the offline decode to float32
rounding, in length as well as in value.

Per request (what the speech pipeline uses)::

    from omnirt.codecs.code2wav import Code2WavStreamer, load_code2wav

    model = load_code2wav("/models/Qwen3-Omni-30B-A3B-Instruct")  # or Code2WavModel.from_hf(m.code2wav)
    streamer = Code2WavStreamer(model, max_slots=32, device="cuda", dtype=torch.bfloat16)
    slot = streamer.acquire()                       # ValueError when every slot is taken
    pcm = streamer.step({slot: codes})              # codes: int [num_quantizers] or [n, num_quantizers]
    pcm[slot]                                       # np.float32 samples, final, in [-1, 1]
    tail = streamer.finish(slot)                    # frees the slot; see below
    streamer.release(slot)                          # (instead of finish) cancel: free at once

One ``step`` call decodes the frames of every slot it is given in one batched model call over
the whole pool (always ``max_slots`` rows, so a stream's output does not depend on which other
slots are busy); the other slots keep their state. A step of several frames costs about what one
does on a GPU (its time is its kernels' launches), so a caller that hands audio out in chunks
decodes a chunk a step. For CUDA graphs, set ``streamer.runners[n]`` to
``CudaGraphRunner(streamer.pool.step_io, partial(streamer.pool.make_inputs, steps=n),
buckets=streamer.buckets)`` from ``stages/graphs.py`` after its ``capture()``, for each ``n`` of
``step_buckets`` (the speech pipeline's ``StreamingVocoder`` does so on CUDA); replay equals the
eager step bitwise. Bad input (unknown slot, wrong number of
codebooks, codes out of ``[0, codebook_size)``, no free slot) raises ``ValueError`` and changes
no stream.

Latency and length. Each decoder block's transposed convolution (kernel 2r, stride r, trimmed
by r at both ends) needs the next input before its last r outputs are final. Over the four
blocks (8, 5, 4, 3) that holds back ``((((1 * 8 + 1) * 5 + 1) * 4 + 1) * 3 = 555`` output
samples (23.1 ms at 24 kHz): after frame ``f`` every sample up to ``(f + 1) * 1920 - 555`` is
final and returned, the first frame gives 1365 samples and every later one 1920. Those are
exactly the samples transformers' offline decode trims, so ``S`` frames give
``S * 1920 - 555`` samples either way and ``finish`` has nothing left to flush (it returns an
empty array). Nothing else is held back: every other convolution is causal.

Layers (each usable alone):

- :mod:`.model`: :class:`Code2WavModel`, the weights under transformers' names, and the
  stream geometry (``samples_per_frame``, ``held_back``, ``offline_length``).
- :mod:`.loading`: :func:`load_code2wav` from a checkpoint folder (``code2wav_config`` and
  ``code2wav.*`` tensors of a Qwen3-Omni checkpoint, or a code2wav-only folder).
- :mod:`.state`: the per-stream state of a pool of slots, preallocated; reset is in place.
- :mod:`.step`: :func:`code2wav_step`, one batched step as a pure tensor function of
  (state, codes, frame counts): no host syncs, no branching on values, CUDA-graph capturable.
- :mod:`.pool`: :class:`Code2WavPool`, the state of a pool and its step, also in the
  dict-in, dict-out form ``stages/graphs.py`` captures (``pool.step_io``, ``pool.make_inputs``).
- :mod:`.streamer`: :class:`Code2WavStreamer`, the per-request API above.
- :mod:`.random_init`: tiny configs and deterministic random weights (tests).
"""

from .loading import load_code2wav
from .model import Code2WavModel
from .pool import Code2WavPool
from .step import code2wav_step
from .streamer import Code2WavStreamer

__all__ = ["Code2WavModel", "Code2WavPool", "Code2WavStreamer", "code2wav_step", "load_code2wav"]
