"""The turn-based speech pipeline (Qwen3-Omni: thinker -> talker -> code2wav).

Public API (import from the modules; importing this package loads nothing heavy):

- :func:`.loader.load_speech_pipeline` -- a :class:`.pipeline.SpeechPipeline` for a checkpoint
  folder in the published layout (``config.json`` + safetensors, tokenizer, preprocessor config).
- :func:`.demo.ensure_demo_checkpoint` -- the embedded default: a tiny Qwen3-Omni with
  deterministic random weights, built into the cache on first use.

Modules: ``pipeline`` (scheduling, the Pipeline protocol), ``slots`` (batched decode over HF
layers with a KV slot pool), ``talker`` (talker inputs, code predictor), ``code2wav`` (vocoder
interface: exact streaming or chunked), ``prompt`` (messages -> prompt tensors), ``detok``,
``sampling``, ``hf_compat``, ``demo`` / ``demo_tokenizer``.
"""
