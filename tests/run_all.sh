#!/usr/bin/env bash
# The whole test suite, after .venv is installed (the README's second command installs it, then runs this;
# CI runs exactly that command: .ci/run).
#
#  1. the two compat venvs (torch 2.9 + torch_xla; Python 3.12) start installing in the background: mostly
#     downloads and unpacking, which overlap the suite instead of adding to it (they start after .venv's
#     install, whose editable build wrote the project's metadata first: two builds at once would race on it);
#  2. the whole suite runs in .venv (Python 3.11, the newest torch);
#  3. once both are done, the tests marked `compat` run at the other ends (tests/compat/run_other_ends.sh).
#
# Fails if any step fails; pytest's exit code 5 (no test collected) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."

install_log=$(mktemp -t pathways-compat-install.XXXXXX)
bash tests/compat/run_other_ends.sh install > "$install_log" 2>&1 &
installer=$!
# Whatever ends this script, the background install does not outlive it.
trap 'kill "$installer" 2>/dev/null || true' EXIT

if [ ! -x .venv/bin/python ]; then
    echo "no .venv here: install it first (python3.11 -m venv .venv && .venv/bin/pip install -e '.[dev]')" >&2
    exit 2
fi
suite=0
.venv/bin/python -m pytest || suite=$?

echo "== waiting for the compat venvs (installing since the start: $install_log)"
if ! wait "$installer"; then
    echo "installing the compat venvs failed; the end of its log:" >&2
    tail -n 40 "$install_log" >&2
    exit 1
fi
trap - EXIT
if [ "$suite" -ne 0 ]; then
    echo "the main suite failed (pytest exit code $suite); the compat ends are not run" >&2
    exit "$suite"
fi
bash tests/compat/run_other_ends.sh test
