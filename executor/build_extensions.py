"""``pathways-build-extensions``: compile the project's C++ extensions.

First the executor's native library (``executor/native``: the shared-memory rings between the executors of a
host; `executor.native_lib`): it needs only a C++ compiler, and has no Python twin, so where it cannot be built
this fails (exit 1) and says what to install.

Then the extension that runs ``pathways::`` collectives inside XLA executables
(`executor.backends.xla_collectives`). It is built from this project's own C++ source
with the machine's compiler, against the headers of the torch and jaxlib installed
beside it (their C++ ABI must match, so it cannot be built ahead of them, in pip's
isolated build environment). The README's install commands run this right after
``pip install``. Where it cannot be built, executors run collectives on the host
between executables instead (slower, same results): this prints why and exits 0
unless ``--strict``.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--strict", action="store_true", help="exit 1 where the extension cannot be built")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    args = parser.parse_args(argv)
    from executor import native_lib

    try:
        began = time.perf_counter()
        path = native_lib.build()
        print(f"pathways-build-extensions: the executor's native library built in {time.perf_counter() - began:.1f} s "
              f"({path})")
    except native_lib.NativeUnavailable as exc:
        print(f"pathways-build-extensions: the executor's native library did not build: {exc}", file=sys.stderr)
        return 1
    try:
        from executor.backends import xla_collectives

        began = time.perf_counter()
        xla_collectives.ensure_built(verbose=args.verbose)
        print(f"pathways-build-extensions: collectives inside XLA built in {time.perf_counter() - began:.1f} s "
              f"({xla_collectives.extension_dir()})")
        return 0
    except Exception as exc:   # no compiler, no headers, a compile error: the pure-Python path remains
        print(f"pathways-build-extensions: not built ({type(exc).__name__}: {str(exc).strip()[:2000]}); executors "
              f"will run collectives on the host between XLA executables (same results, slower)", file=sys.stderr)
        return 1 if args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
