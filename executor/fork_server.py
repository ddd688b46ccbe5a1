"""The fork server's process: imports what every executor imports, once, then forks an executor per request.

Started by `pathways_torch.local.fork_server.ForkServer` (one per client process; ``--with-jax`` imports jax too).
Requests come on stdin, one
JSON line each (``argv``, ``env``, ``log``, ``append``, ``cwd``); on stdout it answers each with ``{"pid": N}`` and
reports every child that ends as ``{"exited": N, "code": C}`` (``C`` as `subprocess.Popen.returncode` has it:
negative for a signal). One thread only: a fork copies the calling thread alone, so no other thread may hold a lock
then. A SIGCHLD wakes the loop through a pipe (``signal.set_wakeup_fd``).

Not imported here: torchax. Importing it initialises JAX's backend (its threads and its client), and an executor
forked after that hung at its first call (measured). Each executor imports it itself.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback


def _emit(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _emit({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _run_executor(request: dict, executor_main, wake_fds) -> int:
    """In the forked child: become the executor process ``request`` describes, as Popen would have started it."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in wake_fds:
        os.close(fd)
    os.setsid()
    os.chdir(request["cwd"])
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
    log = os.open(request["log"], flags, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["argv"]]
    try:
        executor_main.main(request["argv"])
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def main() -> None:
    from executor.allocator import DEFAULT_MMAP_THRESHOLD_MB, tune_allocator
    from pathways_torch.wire.crash_stacks import enable_crash_stacks

    enable_crash_stacks()   # the server's own stderr; each executor enables it again on its log (executor.__main__)

    tune_allocator(DEFAULT_MMAP_THRESHOLD_MB)   # before torch allocates, as executor/__main__.py does
    if "--with-jax" in sys.argv[1:]:   # for the XLA route; eager and inductor executors never import it
        import jax  # noqa: F401  (no backend is initialised by the import)
    import torch  # noqa: F401

    import executor.__main__ as executor_main
    import executor.process  # noqa: F401

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _emit({"ready": os.getpid()})
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap()
        if 0 not in readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:   # the client closed us (or died): its executors stop on their own (--parent-pid)
            # At once: this process holds nothing to tidy, and the interpreter's teardown with torch and jax loaded
            # took about a second, which the client's exit waited for (`ForkServer.close`).
            sys.stdout.flush()
            os._exit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                code = _run_executor(request, executor_main, (wake_read, wake_write))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            _emit({"pid": pid})


if __name__ == "__main__":
    main()
