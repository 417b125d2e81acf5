"""Step caches of the diffusion runtime: TeaCache and MagCache, calibrated per model.

- :mod:`.config`: the request and server options (``cache_backend``, ``cache_config``);
- :mod:`.teacache`, :mod:`.magcache`: the two skip rules (device arithmetic; host schedule);
- :mod:`.probes`: what TeaCache measures per model family;
- :mod:`.calibration`: the calibration files, their lookup by model, the unknown-model error;
- :mod:`.state`: per request, branch and row state, and one call's decision (what the runtime,
  :mod:`..pipeline`, calls);
- :mod:`.calibrate`: ``omnirt calibrate teacache|magcache``.
"""
