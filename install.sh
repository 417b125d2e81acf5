#!/usr/bin/env bash
# Sets up a fresh Debian/Ubuntu machine for omnirt: system packages used by the tests
# (espeak-ng and sox make real speech; chromium runs the browser tests), then a virtual
# environment in .venv with omnirt installed editable, its dev tools, the voice-agent frameworks
# the tests drive (openai-agents, pipecat, livekit), Ray Serve (the ray extra: omnirt serve --replicas),
# cuDNN's front end (the cudnn extra: fp8 attention) and torch.
set -euo pipefail
cd "$(dirname "$0")"

SYSTEM_PACKAGES=(espeak-ng sox chromium)

missing=()
for pkg in "${SYSTEM_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing system packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# torch is pinned in the same command as the rest: alone, pip would pick a newer CUDA build.
.venv/bin/pip install -q torch==2.13.0 -e '.[dev,frameworks,ray,cudnn]'
echo "omnirt is installed in .venv: run '.venv/bin/omnirt serve' (or '.venv/bin/pytest' for the tests)"
