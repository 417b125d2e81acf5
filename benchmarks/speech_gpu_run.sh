#!/usr/bin/env bash
# One lent-GPU call that re-measures the speech pipeline at real size (docs/benchmarks.md,
# "Speech at real size on CUDA graphs"): the speech GPU tests, each stage of a tick alone, and
# sessions speaking at once, each bounded in time so the whole stays within one 10-minute call.
# Run from the repository root with the package importable (../shared/tools/gpu-wheels.sh prints
# the line that makes it so). Writes tests.log, steps.md and capacity.md into ${OUT:-.}.
set -uo pipefail
out=${OUT:-.}
config=benchmarks/models/qwen3-omni-30b-a3b-instruct
export PYTHONUNBUFFERED=1
timeout 240 python -m pytest -m gpu -s -q -p no:cacheprovider tests/speech/test_speech_gpu.py \
    tests/gpu/test_rms_norm_gpu.py tests/gpu/test_moe_route_gpu.py tests/gpu/test_sampler_gpu.py \
    >"$out/tests.log" 2>&1
grep -E "passed|failed|\[gpu\]|FAILED|^E  " "$out/tests.log" | head -60
timeout 180 python benchmarks/speech_steps.py --load-format dummy --model "$config" --batches 1 32 128 \
    --iters 8 --eager-iters 2 --kernels-baseline --prefill-phases --profile-steps 32 >"$out/steps.md" 2>/dev/null
cat "$out/steps.md"
timeout 260 python benchmarks/speech_capacity.py --load-format dummy --model "$config" --sessions 1 32 64 128 \
    --seconds 4 --modes graphs --level-timeout 45 --time-budget 200 --profile 128 --profile-ticks 8 \
    2>&1 | grep -v "Unrecognized keys" >"$out/capacity.md"
cat "$out/capacity.md"
