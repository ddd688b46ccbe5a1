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
# Fails if any step fails, with the main suite's pytest exit code when it failed (5: no test collected).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    echo "no .venv here: install it first (python3.11 -m venv .venv && .venv/bin/pip install -e '.[dev]')" >&2
    exit 2
fi

install_log=$(mktemp -t pathways-compat-install.XXXXXX)
# A session of its own (setsid): stopping it stops its pip processes too, not only the shell that runs them. At the
# lowest CPU and I/O priority (nice, ionice idle): the suite leaves a core idle much of the time, which the install
# takes, instead of slowing the suite's processes down.
low_priority=(nice -n 19)
if command -v ionice > /dev/null; then low_priority+=(ionice -c 3); fi
setsid "${low_priority[@]}" bash tests/compat/run_other_ends.sh install > "$install_log" 2>&1 < /dev/null &
installer=$!
stop_installer() { kill -TERM -- "-$installer" 2>/dev/null || true; }
trap stop_installer EXIT
trap 'stop_installer; exit 130' INT TERM

suite=0
.venv/bin/python -m pytest || suite=$?
if [ "$suite" -ne 0 ]; then
    echo "the main suite failed (pytest exit code $suite); the compat ends are not run" >&2
    exit "$suite"
fi

echo "== waiting for the compat venvs (installing since the suite started; log: $install_log)"
if ! wait "$installer"; then
    echo "installing the compat venvs failed; the end of its log ($install_log):" >&2
    tail -n 40 "$install_log" >&2
    exit 1
fi
trap - EXIT INT TERM
rm -f "$install_log"
bash tests/compat/run_other_ends.sh test
