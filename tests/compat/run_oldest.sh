#!/usr/bin/env bash
# The oldest end of the supported torch range, where both XLA routes exist: torch 2.9.0 with torch_xla
# 2.9.0 (the 'torch-xla' extra) and torchax + jax, Python 3.11. Runs the tests marked `compat`
# (capture and the wire schema, both XLA routes, one training run of the example). The whole suite
# runs at the newest end (the README's test command, before this script).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3.11 -m venv .venv-oldest
.venv-oldest/bin/pip install -q -e '.[dev,torch-xla]'
# torch_xla 2.9.0's wheel carries its own torchax (0.0.6, which needs flax) and overwrites the
# installed one; put the torchax the project needs back (docs/backends.md says the same to users).
.venv-oldest/bin/pip install -q --force-reinstall --no-deps 'torchax>=0.0.13,<0.1'
.venv-oldest/bin/python - <<'PY'
import torch
assert torch.__version__.startswith("2.9."), f"expected torch 2.9 at this end of the range, got {torch.__version__}"
print(f"oldest end: torch {torch.__version__}")
PY
# pytest exits 5 when nothing is collected: with `set -e` that fails the run.
.venv-oldest/bin/python -m pytest -m compat -q
