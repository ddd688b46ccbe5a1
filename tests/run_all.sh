#!/usr/bin/env bash
# The whole test suite, after .venv is installed (the README's second command installs it, then runs this;
# CI runs exactly that command: .ci/run).
#
#  1. the whole suite runs in .venv (Python 3.11, the newest torch), on two pytest workers;
#  2. the two compat venvs (torch 2.9 + torch_xla; Python 3.12) install;
#  3. the tests marked `compat` run at those other ends (tests/compat/run_other_ends.sh).
#
# One after the other: with two workers the suite leaves the 2-core machine little idle time, and the installs
# running beside it (as they did while the suite ran one test at a time) slowed it from 826 s to 960 s in a fresh
# clone, writing several GB while the tests started processes and wrote checkpoints. Alone, both ends install and
# test in 288 s (their dependencies installing at once; measured on the 2-core machine).
#
# Fails if any step fails, with the main suite's pytest exit code when it failed (5: no test collected).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    echo "no .venv here: install it first (python3.11 -m venv .venv && .venv/bin/pip install -e '.[dev]')" >&2
    exit 2
fi

# Two pytest workers, a test file each at a time (--dist loadfile: a module's shared contexts stay on one worker).
# Measured on the 2-core machine: 680 s against 1,041 s one at a time, the same tests passing; the suite waits on
# processes, heartbeats and deadlines much of the time, which the other worker fills.
suite=0
.venv/bin/python -m pytest -n 2 --dist loadfile || suite=$?
if [ "$suite" -ne 0 ]; then
    echo "the main suite failed (pytest exit code $suite); the compat ends are not run" >&2
    exit "$suite"
fi

echo "== installing the compat venvs"
bash tests/compat/run_other_ends.sh install
bash tests/compat/run_other_ends.sh test
