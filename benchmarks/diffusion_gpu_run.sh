#!/usr/bin/env bash
# One lent-GPU call that measures image and video diffusion beside realtime speech at real size
# (docs/benchmarks.md, "Realtime with diffusion (issue 10)"): the diffusion GPU tests, then
# benchmarks/realtime_with_diffusion.py with the published configs (Qwen3-Omni-30B-A3B, Z-Image-Turbo
# 1024x1024 8 steps, Wan2.1 1.3B 480p 81 frames) and seeded random bf16 weights, each part bounded
# in time so the whole stays under 9 minutes of one 10-minute call. Wan jobs run 2 denoising steps
# (not the published 50) so that several finish inside a 15 s window; steps/s does not depend on it.
#
# Run from the repository root with the package importable. The GPU image lacks diffusers and av
# and has transformers 5.17 (the speech pipeline needs >= 5.24): make the wheels here with
#   ../shared/tools/gpu-wheels.sh diffusers==0.42.1 av==18.1.0 importlib_metadata==10.2.0
# and start the call with the line it prints (carry .whl and .gpu-src). The av wheel alone is 36 MB:
# if the set passes the 64 MiB carry limit, keep only what this run imports (transformers,
# diffusers, av, importlib_metadata, soxr, soundfile, cffi, pycparser).
# Writes tests.log and bench.md into ${OUT:-.}.
set -uo pipefail
out=${OUT:-.}
py=${PYTHON:-python3}
models=benchmarks/models
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
start=$(date +%s)

timeout 150 "$py" -m pytest -m gpu -s -q -p no:cacheprovider tests/diffusion >"$out/tests.log" 2>&1
echo "tests: exit $? after $(($(date +%s) - start)) s"
grep -E "passed|failed|skipped|FAILED|ERROR|\[gpu\]" "$out/tests.log"

timeout 330 "$py" benchmarks/realtime_with_diffusion.py --load-format dummy \
    --speech-model "$models/qwen3-omni-30b-a3b-instruct" \
    --image-model "$models/z-image-turbo/z-image-turbo.components.json" \
    --video-model "$models/wan2.1-t2v/wan2.1-t2v.components.json" --video-variant 1.3b \
    --sessions 8 --max-output-tokens 8 --max-audio-frames 24 --video-steps 2 \
    --seconds 15 --phase-timeout 45 --time-budget 290 --dit-iters 10 --first-audio-targets 0.25 none \
    2>&1 | grep -v "Unrecognized keys" >"$out/bench.md"
echo "benchmark: exit ${PIPESTATUS[0]} after $(($(date +%s) - start)) s in all"
cat "$out/bench.md"
