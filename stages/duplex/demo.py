"""The embedded default's duplex model: a tiny Moshi with deterministic random weights.

Every part of ``MoshiForConditionalGeneration`` at toy size (temporal hidden 64, 2 layers;
depth hidden 32, 2 layers; ``K = 8`` codebooks of 64 codes) and a tiny Mimi with the real
frame (1920 samples at 24 kHz, 80 ms: the real upsampling ratios, tiny channels). The weights
go through the same builders as a checkpoint (:func:`.loader.build_weights`, ``build_mimi``).
Text uses the speech demo's byte-level tokenizer (``stages/speech/demo_tokenizer.py``, wrapped
as a transformers ``PreTrainedTokenizerFast`` like a checkpoint's), so the text stream decodes;
``<tts_pad>`` is its padding id and ``<tts_text_bos>`` its end of padding.

A random text head would babble a token every frame. To give the demo Moshi's on/off rhythm
(stretches of silence, stretches of "speech" that start and end), the text embeddings put the
residual stream in one of two states, "silent" (after a padding token) or "talking" (after any
other token), and the text head reads the state: while silent the pad token keeps most of the
mass, while talking lowercase letters and spaces do, with a small chance per frame to fall
silent. Under the default sampling (text temperature 0.7) about 70% of frames are padding, in
silences of up to a few seconds between babbled stretches of up to about a second; greedy
decoding stays silent.

A random Mimi turns any codes into loud noise, so the demo's audio would never be quiet. As a
real Moshi is silent when it does not talk, the demo's audio follows the same two states: code 0
of every codebook is the "silence" code (a zero codebook vector, and the codec has no biases, so
frames of silence codes decode to exact zeros once the decoder's short context has passed), and
the depth decoder picks it, for every codebook, after a padding text token (a "quiet" direction
in the depth text embedding of the pad token and in the embedding of code 0, read by every depth
head's row 0). So while the model talks its audio is loud noise, and a few frames after its text
falls silent its audio is silence: text and audio level agree on where speech starts and stops.
"""

from __future__ import annotations

import string

import torch

from ...codecs.mimi import MimiCodecConfig, StreamingMimi, build_mimi
from ...codecs.mimi.reference import TINY_MIMI, randomize_codebooks
from ..speech.demo_tokenizer import build_tokenizer
from .lm import DuplexLM
from .loader import build_weights

DEMO_SEED = 4321
K = 8
#: Scale of the two state directions in the text embeddings (the audio embeddings sum to ~0.6).
STATE_SCALE = 2.0
#: Size of the depth decoder's "quiet" direction (module doc), and the weight its heads read it with.
QUIET_SCALE, QUIET_GAIN = 4.0, 8.0
#: Text-head weights on the state directions (see the module doc), tuned at temperature 0.7
#: (about 70% of frames padding, silences of 1-40 frames, babble of 1-15 frames).
PAD_WHEN_SILENT, PAD_WHEN_TALKING, WORDS_WHEN_TALKING, OTHERS_WHEN_TALKING = 0.62, 0.22, 0.1, -0.5


def demo_config(vocab_size: int, pad_id: int, end_pad_id: int):
    from transformers import MoshiConfig

    return MoshiConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        ffn_dim=128,
        max_position_embeddings=3000,
        sliding_window=3000,
        num_codebooks=K,
        audio_encoder_config=dict(TINY_MIMI),
        depth_decoder_config={
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "ffn_dim": 64,
        },
        existing_text_padding_id=pad_id,
        existing_text_end_padding_id=end_pad_id,
    )


def _word_ids(tokenizer) -> list[int]:
    wanted = set(string.ascii_lowercase + " ")
    return [i for i in range(tokenizer.get_vocab_size()) if tokenizer.decode([i]) in wanted]


@torch.no_grad()
def _shape_text(model, pad_id: int, words: list[int], seed: int) -> None:
    """The silent/talking states (module doc) in the text embeddings and the text head."""
    hidden = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(hidden, 2, generator=generator))
    silent, talking = basis[:, 0], basis[:, 1]
    embed = model.decoder.model.embed_tokens.weight  # [vocab + 1, H]; the last row is the start id
    embed.add_(STATE_SCALE * talking)
    embed[pad_id].add_(STATE_SCALE * (silent - talking))
    embed[-1].add_(STATE_SCALE * (silent - talking))  # a conversation starts silent
    head = model.decoder.lm_head.weight  # [vocab, H]
    head.add_(OTHERS_WHEN_TALKING * talking)
    head[words] += (WORDS_WHEN_TALKING - OTHERS_WHEN_TALKING) * talking
    head[pad_id] = PAD_WHEN_SILENT * silent + PAD_WHEN_TALKING * talking


@torch.no_grad()
def _shape_audio(model, pad_id: int, seed: int) -> None:
    """Silence codes after padding text, and a codec that decodes them to silence (module doc)."""
    depth = model.depth_decoder
    generator = torch.Generator().manual_seed(seed + 1)
    quiet = torch.randn(depth.config.hidden_size, generator=generator)
    quiet /= quiet.norm()
    depth.text_embed_tokens.weight[pad_id] += QUIET_SCALE * quiet
    for embed in depth.embed_tokens:  # codebooks 0..K-2 as the inputs of sub-steps 1..K-1
        embed.weight[0] += QUIET_SCALE * quiet
    depth.lm_heads.weight[:, 0] += QUIET_GAIN * quiet
    codec = model.audio_encoder
    for name, param in codec.named_parameters():
        if name.endswith("bias"):
            param.zero_()
    for name, buffer in codec.named_buffers():
        if name.endswith("embed_sum"):  # a codebook: its code 0 is the zero vector
            buffer[0].zero_()


def demo_duplex(
    max_slots: int,
    device: torch.device | str,
    *,
    graphs: bool = True,
    seed: int = DEMO_SEED,
    kv_dtype: str = "auto",
    max_frames: int | None = None,
) -> tuple[DuplexLM, StreamingMimi, object]:
    """The demo LM, its Mimi and its tokenizer (a transformers ``PreTrainedTokenizerFast``, what
    the pipeline's incremental detokenizer reads, as a checkpoint's would be);
    ``kv_dtype`` and ``max_frames`` as for :class:`DuplexLM`."""
    from transformers import MoshiForConditionalGeneration, PreTrainedTokenizerFast

    tokenizer = build_tokenizer()
    pad_id = tokenizer.token_to_id("<tts_pad>")
    end_pad_id = tokenizer.token_to_id("<tts_text_bos>")
    config = demo_config(tokenizer.get_vocab_size(), pad_id, end_pad_id)
    with torch.random.fork_rng(devices=[]):  # leave the process's global RNG as it was
        torch.manual_seed(seed)
        model = MoshiForConditionalGeneration(config).eval()
    randomize_codebooks(model.audio_encoder, seed)
    with torch.no_grad():  # flexible linears start as randn (std 1): scale them like the rest
        for param in model.depth_decoder.parameters():
            if param.dim() == 3:
                param.mul_(param.shape[-1] ** -0.5)
    _shape_text(model, pad_id, _word_ids(tokenizer), seed)
    _shape_audio(model, pad_id, seed)
    state = model.state_dict()
    prefix = "audio_encoder."
    weights = build_weights(config, {k: v for k, v in state.items() if not k.startswith(prefix)})
    codec = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    mimi_config = MimiCodecConfig.from_dict(config.audio_encoder_config.to_dict())
    mimi = build_mimi(mimi_config, codec, num_quantizers=K, device=device)
    lm = DuplexLM(
        weights,
        config,
        max_slots=max_slots,
        device=device,
        dtype=torch.float32,
        graphs=graphs,
        kv_dtype=kv_dtype,
        max_frames=max_frames,
    )
    return lm, mimi, PreTrainedTokenizerFast(tokenizer_object=tokenizer)
