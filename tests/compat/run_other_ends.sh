#!/usr/bin/env bash
# The other ends of what the project supports, each running the tests marked `compat` (capture and
# the wire schema, stage plans, both XLA routes, the torchax shims, one training run of the example).
# The whole suite runs at the newest torch on Python 3.11 (tests/run_all.sh runs it, then this).
#  1. the oldest torch, where both XLA routes exist: torch 2.9.0 with torch_xla 2.9.0 (the 'torch-xla'
#     extra) and torchax + jax, Python 3.11;
#  2. Python 3.12 with the newest torch and jax pip takes (the GPU machine's Python).
#
#   bash tests/compat/run_other_ends.sh            install both ends, then test them
#   bash tests/compat/run_other_ends.sh install    only install (tests/run_all.sh does it while the suite runs)
#   bash tests/compat/run_other_ends.sh test       only test (installed before)
set -euo pipefail
cd "$(dirname "$0")/../.."
what="${1:-all}"
case "$what" in all|install|test) ;; *) echo "usage: $0 [all|install|test], got '$what'" >&2; exit 2 ;; esac

find_python312() {
    if python3.12 -c '' 2>/dev/null; then
        command -v python3.12
    else   # a pyenv shim that is not enabled answers but does not run: look where pyenv keeps it
        ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 2>/dev/null \
            | head -n 1 || true
    fi
}

install() {
    # Two more venvs of torch (several GB each, a CUDA build from PyPI for the second): pip's cache would keep
    # a second copy of every wheel it downloads, and a CI machine once ran out of disk here (Errno 28).
    export PIP_NO_CACHE_DIR=1
    echo "== free disk before the compat installs: $(df -h --output=avail . | tail -n 1 | tr -d ' ')"
    echo "== install compat 1/2: torch 2.9.0 + torch_xla 2.9.0, Python 3.11"
    python3.11 -m venv .venv-oldest
    # Bytecode is compiled here, in the background of the main suite (with --no-compile the compat tests
    # paid it at their first imports: 104 s and 95 s instead of 70 s and 55 s, measured).
    .venv-oldest/bin/pip install -q -e '.[dev,torch-xla]'
    # torch_xla 2.9.0's wheel carries its own torchax (0.0.6, which needs flax) and overwrites the
    # installed one; put the torchax the project needs back (docs/backends.md says the same to users).
    .venv-oldest/bin/pip install -q --force-reinstall --no-deps 'torchax>=0.0.13,<0.1'
    echo "== install compat 2/2: Python 3.12, newest torch"
    local python312
    python312=$(find_python312)
    if [ -z "$python312" ]; then
        echo "NOT RUN: no Python 3.12 interpreter on this machine (install one to run this end)" >&2
        exit 1
    fi
    "$python312" -m venv .venv-py312
    .venv-py312/bin/pip install -q -e '.[dev]'
}

test_oldest() {
    echo "== compat 1/2: torch 2.9.0 + torch_xla 2.9.0, Python 3.11"
    .venv-oldest/bin/python -c "import torch; v = torch.__version__; assert v.startswith('2.9.'), v; print('torch', v)"
    # pytest exits 5 when nothing is collected: with `set -e` that fails the run.
    .venv-oldest/bin/python -m pytest -m compat -q -p no:cacheprovider
}

test_py312() {
    echo "== compat 2/2: Python 3.12, newest torch"
    .venv-py312/bin/python -c "import sys, torch, jax; print('python', sys.version.split()[0], 'torch', torch.__version__, 'jax', jax.__version__)"
    .venv-py312/bin/python -m pytest -m compat -q -p no:cacheprovider
}

run_tests() {
    # Both ends at once, each with a log of its own, printed when both are done: they share no file (each pytest
    # process makes its own compile cache, tests/conftest.py) and each leaves a core idle much of the time.
    local logs oldest=0 py312=0
    logs=$(mktemp -d -t pathways-compat-logs.XXXXXX)
    test_oldest > "$logs/oldest" 2>&1 &
    local oldest_pid=$!
    test_py312 > "$logs/py312" 2>&1 &
    local py312_pid=$!
    wait "$oldest_pid" || oldest=$?
    wait "$py312_pid" || py312=$?
    cat "$logs/oldest" "$logs/py312"
    rm -rf "$logs"
    if [ "$oldest" -ne 0 ] || [ "$py312" -ne 0 ]; then
        echo "compat failed: torch 2.9 end exit code $oldest, Python 3.12 end exit code $py312" >&2
        exit 1
    fi
}

if [ "$what" != test ]; then install; fi
if [ "$what" != install ]; then run_tests; fi
