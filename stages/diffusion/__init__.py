"""Image and video generation (diffusion) in the engine's process, scheduled beside realtime speech.

- :mod:`.types`: the requests (:class:`~.types.ImageRequest`, :class:`~.types.VideoRequest`) and the
  outputs (progress, previews, images, videos) that cross to the HTTP handlers.
- :mod:`.denoiser`: what one model family (Z-Image, Wan) provides to the runtime: prompt encoding,
  latents, one transformer call per CFG branch, the guidance combine, the sampler, VAE decode.
- The runtime (a :class:`~omnirt.stages.pipeline.Pipeline` of ``BATCH`` priority) owns the step
  loop: batching of compatible requests, one transformer call per scheduler step (so a realtime
  tick never waits behind more than one), progress, previews, cancellation.
"""
