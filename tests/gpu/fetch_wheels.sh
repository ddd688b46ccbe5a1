#!/usr/bin/env bash
# Fetch, on this (networked) machine, the wheels tests/gpu/run_on_device.sh installs on a lent GPU machine
# (Python 3.12, x86-64, no network; its image already has torch, jax, numpy, grpcio, protobuf, pytest,
# pytest-timeout, safetensors, tqdm). They go to .whl/, which git ignores (.git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl 'pyzmq>=26,<28' 'torchax==0.0.13'
ls -la .whl
