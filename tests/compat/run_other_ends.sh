#!/usr/bin/env bash
# The other ends of what the project supports, each running the tests marked `compat` (capture and
# the wire schema, stage plans, both XLA routes, the torchax shims, one training run of the example).
# The whole suite runs at the newest torch on Python 3.11 (tests/run_all.sh runs it, then this).
#  1. the oldest torch, where both XLA routes exist: torch 2.9.0 with torch_xla 2.9.0 (the 'torch-xla'
#     extra) and torchax + jax, Python 3.11;
#  2. Python 3.12 with the newest torch and jax pip takes (the GPU machine's Python).
#
#   bash tests/compat/run_other_ends.sh            install both ends, then test them
#   bash tests/compat/run_other_ends.sh install    only install (tests/run_all.sh does it after the main suite)
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

requirements() {
    # The project's dependencies and those of the extras named, one per line, from pyproject.toml.
    python3.11 - "$@" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join([*project["dependencies"], *(r for extra in sys.argv[1:] for r in project["optional-dependencies"][extra])]))
PY
}

install_oldest_dependencies() {
    .venv-oldest/bin/pip install -q -r "$1"
    # torch_xla 2.9.0's wheel carries its own torchax (0.0.6, which needs flax) and overwrites the
    # installed one; put the torchax the project needs back (docs/backends.md says the same to users).
    .venv-oldest/bin/pip install -q --force-reinstall --no-deps 'torchax>=0.0.13,<0.1'
}

install() {
    # Two more venvs of torch (several GB each, a CUDA build from PyPI for the second): pip's cache would keep
    # a second copy of every wheel it downloads, and a CI machine once ran out of disk here (Errno 28).
    export PIP_NO_CACHE_DIR=1
    echo "== free disk before the compat installs: $(df -h --output=avail . | tail -n 1 | tr -d ' ')"
    local python312
    python312=$(find_python312)
    if [ -z "$python312" ]; then
        echo "NOT RUN: no Python 3.12 interpreter on this machine (install one to run this end)" >&2
        exit 1
    fi
    python3.11 -m venv .venv-oldest
    "$python312" -m venv .venv-py312
    local work oldest=0 py312=0
    work=$(mktemp -d -t pathways-compat-install.XXXXXX)
    requirements dev torch-xla > "$work/oldest.txt"
    requirements dev > "$work/py312.txt"
    # Both ends' dependencies at once (downloads and unpacking overlap: 230 s one after the other); bytecode is
    # compiled here, at install (with --no-compile the compat tests paid it at their first imports: 104 s and
    # 95 s instead of 70 s and 55 s, measured). The project itself after, one end at a time: two editable builds
    # of one source tree at once would race on its metadata.
    echo "== install compat 1/2 (torch 2.9.0 + torch_xla 2.9.0, Python 3.11) and 2/2 (Python 3.12, newest torch)"
    install_oldest_dependencies "$work/oldest.txt" > "$work/oldest.log" 2>&1 &
    local oldest_pid=$!
    .venv-py312/bin/pip install -q -r "$work/py312.txt" > "$work/py312.log" 2>&1 &
    local py312_pid=$!
    wait "$oldest_pid" || oldest=$?
    wait "$py312_pid" || py312=$?
    grep -v "^WARNING: Location" "$work/oldest.log" "$work/py312.log" || true
    rm -rf "$work"
    if [ "$oldest" -ne 0 ] || [ "$py312" -ne 0 ]; then
        echo "installing the compat ends failed: torch 2.9 end exit code $oldest, Python 3.12 end exit code $py312" >&2
        exit 1
    fi
    .venv-oldest/bin/pip install -q --no-deps -e .
    .venv-py312/bin/pip install -q --no-deps -e .
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
