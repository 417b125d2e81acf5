"""The turn-based speech pipeline (Qwen3-Omni: thinker -> talker -> code2wav).

Public API (import from the modules; importing this package loads nothing heavy):

- :func:`.loader.load_speech_pipeline` -- a :class:`.pipeline.SpeechPipeline` for a checkpoint
  folder in the published layout (``config.json`` + safetensors, tokenizer, preprocessor config).
- :func:`.demo.ensure_demo_checkpoint` -- the embedded default: a tiny Qwen3-Omni with
  deterministic random weights, built into the cache on first use.

Modules: ``pipeline`` (the tick, the Pipeline protocol), ``thinker`` / ``talker`` (per-slot
device state, prompt passes and decode steps on CUDA graphs), ``talker_prompt`` (the talker's
prompt as ``generate`` builds it), ``prefill`` (reading new prompts, inline or on a worker),
``slots`` (batched decode and prompt passes over HF layers with a static KV slot pool),
``sampling`` / ``draws`` (the batched counter-based sampler, per-slot parameters), ``text_out``
(detokenising, stop strings, tool calls held back), ``tool_calls`` (the ``<tool_call>`` format:
splitting a reply, parsing a call), ``constrain`` / ``token_masks`` (grammar-constrained decoding
with llguidance: tool choice and response formats, per-slot token masks), ``code2wav`` (vocoder
interface: exact streaming or chunked), ``prompt`` (messages -> prompt tensors), ``memory`` (the
slots' GPU memory plan), ``loader`` / ``dummy`` (checkpoints, and random weights at real size from
a config), ``detok``, ``hf_compat``, ``demo`` / ``demo_tokenizer``.
"""
