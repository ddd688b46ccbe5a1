"""The example trainer on CUDA executors: the CUDA default (inductor), NCCL collectives. Skipped without a GPU.

tests/gpu/run_on_device.sh runs it on a lent GPU machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_example_trains_on_cuda_executors_with_inductor_and_nccl(tmp_path):
    executors = min(2, torch.cuda.device_count())
    result = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "train_transformer.py"), "--device", "cuda",
         "--executors", str(executors), "--steps", "300",
         "--checkpoint", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=840, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    first, last = map(float, re.search(r"loss: ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    accuracy = float(re.search(r"accuracy \(1024 sequences\): ([\d.]+)%", result.stdout).group(1))
    assert last < first / 10 and accuracy >= 90.0, result.stdout
    assert "backend: inductor" in result.stdout, result.stdout     # device="cuda" picks inductor by itself
