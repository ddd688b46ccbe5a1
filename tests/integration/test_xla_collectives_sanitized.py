"""The collectives-inside-XLA extension built with AddressSanitizer and UndefinedBehaviorSanitizer, run through the
two-rank scenario of test_xla_collectives.py (every collective and dtype, an abandon, an op abandoned that ends
after its executable failed): a use after free or undefined behaviour in our C++ is reported and fails the test.

Opt-in (``PATHWAYS_SANITIZER_TESTS=1``): the sanitized build takes about 3.5 minutes on 2 cores. Run it after a
change to executor/backends/native/xla_collectives.cpp (issue 47's SIGSEGV was a use after free there).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900),
              pytest.mark.skipif(os.environ.get("PATHWAYS_SANITIZER_TESTS") != "1",
                                 reason="opt-in: PATHWAYS_SANITIZER_TESTS=1 (a sanitized build takes minutes)")]

SANITIZERS = "-fsanitize=address,undefined"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sanitized_build(folder: str) -> str:
    import jax.ffi

    from executor.backends import xla_collectives

    source = os.path.join(os.path.dirname(xla_collectives.__file__), "native", "xla_collectives.cpp")
    script = ("import torch.utils.cpp_extension as c\n"
              f"c.load('pathways_xla_collectives', [{source!r}], extra_include_paths=[{jax.ffi.include_dir()!r}], "
              f"extra_cflags=['-O1', '-g', '-fno-omit-frame-pointer', {SANITIZERS!r}, '-Wno-return-type'], "
              f"extra_ldflags=[{SANITIZERS!r}], build_directory={folder!r})\n")
    # Built in a child: importing the sanitized library into a process without the ASan runtime first fails.
    subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    library = os.path.join(folder, "pathways_xla_collectives.so")
    assert os.path.exists(library), f"the sanitized build left no {library}"
    return library


_RANKS = """
import sys
from bench.common import run_ranks
from tests.integration import test_xla_collectives as scenarios

def sanitized(target):
    def run(rank, size, store_path, results):
        from executor.backends import xla_collectives
        xla_collectives.load({library!r})
        target(rank, size, store_path, results)
    return run

def each(*args): sanitized(scenarios._rank)(*args)

if __name__ == "__main__":
    rows = run_ranks(each, 2, (2,), "pathways-test-sanitized-", timeout_s=400)
    print("late", rows[0][1].get("late abandoned"), rows[0][1].get("late fills"), flush=True)
"""


def _runtime(name: str) -> str:
    return subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()


def test_the_collectives_extension_runs_clean_under_asan_and_ubsan(tmp_path):
    library = _sanitized_build(str(tmp_path / "build"))
    script = tmp_path / "sanitized_ranks.py"
    script.write_text(_RANKS.format(library=library))
    # libstdc++ preloaded too: ASan's __cxa_throw interceptor finds nothing to wrap otherwise (jaxlib throws).
    env = {**os.environ, "LD_PRELOAD": f"{_runtime('libasan.so')} {_runtime('libstdc++.so.6')}",
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    report = done.stdout + done.stderr
    assert "AddressSanitizer" not in report and "runtime error:" not in report, report[-20000:]
    assert done.returncode == 0, report[-20000:]
    assert "late CollectiveAbandoned" in done.stdout and "[(7.0, 7.0)]" in done.stdout, done.stdout
