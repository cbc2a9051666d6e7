#!/usr/bin/env bash
# Here (not on the GPU machine, which reaches no registry): download into .whl/ the wheels the H200 image lacks, for
# Python 3.12 on x86-64, so a device call can carry them (`carry: [".whl"]`; scripts/carried_wheels.sh installs them).
# .whl/ is ignored by git (this script adds it to .git/info/exclude), so every new checkout runs this once.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# fla-core: the gated delta rule's chunk prefill. The server stack: `jetserve serve` / `bench serving` on the GPU.
PACKAGES=(fla-core==0.6.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4
  annotated-types==0.8.0 typing-inspection==0.4.5)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${PACKAGES[@]}"
ls -1 .whl
