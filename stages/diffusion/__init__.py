"""Image and video generation (diffusion) in the engine's process, scheduled beside realtime speech.

- :mod:`.types`: the requests (:class:`~.types.ImageRequest`, :class:`~.types.VideoRequest`) and the
  outputs (progress, previews, images, videos) that cross to the HTTP handlers.
- :mod:`.denoiser`: what one model family (Z-Image, Wan) provides to the runtime: prompt encoding,
  latents, one transformer call per CFG branch, the guidance combine, the sampler, VAE decode.
- :mod:`.pipeline`: the runtime, :class:`~.pipeline.DiffusionPipeline` (a
  :class:`~omnirt.stages.pipeline.Pipeline` of ``BATCH`` priority), owns the step loop: batching
  of compatible requests, one model call per scheduler step (so a realtime tick never waits behind
  more than one transformer call), progress, previews, cancellation. :mod:`.media` encodes PNGs
  and MP4s.
- :mod:`.cache`: the step caches (TeaCache, MagCache) the runtime applies at the split-call seam,
  their calibration files and ``omnirt calibrate``.
- :mod:`.zimage` (the Z-Image denoiser), :mod:`.zimage_loader` (diffusers folders, random weights
  from configs), :mod:`.zimage_demo` (the tiny embedded default).
"""
