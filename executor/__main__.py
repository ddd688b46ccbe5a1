"""``python -m executor --controller ADDR`` (also the ``pathways-executor`` console script)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

from pathways_torch.wire.crash_stacks import enable_crash_stacks

from .allocator import DEFAULT_MMAP_THRESHOLD_MB, tune_allocator
from .config import BACKENDS, ExecutorConfig

__all__ = ["main", "parse_args"]


def parse_args(argv=None) -> ExecutorConfig:
    parser = argparse.ArgumentParser(prog="pathways-executor", description="Run one pathways_torch executor.")
    parser.add_argument("--controller", required=True, help="controller endpoint, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--id", default=f"{socket.gethostname()}-{os.getpid()}", help="executor id")
    parser.add_argument("--keys-dir", "--keys", dest="keys", required=True,
                        help="key directory made by the launcher (`pathways-run --make-keys`): public/*.key (the "
                             "allow-list) and secret/ID.key_secret (this executor's pair)")
    parser.add_argument("--backend", default="eager", choices=BACKENDS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--host-addr", "--bind-host", dest="bind_host", default="127.0.0.1",
                        help="the address this executor binds and advertises for tensor traffic, commands and "
                             "collectives (loopback by default; another host's executors must reach it)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads (torch.set_num_threads)")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                        help="until the controller's Welcome says otherwise (its settings rule once registered)")
    parser.add_argument("--join-timeout-s", type=float, default=60.0,
                        help="how long to wait for the controller's first answer before giving up")
    parser.add_argument("--cpus", default="", help="pin the process to these cores, e.g. 0 or 0,1 (default: all)")
    parser.add_argument("--island", default="",
                        help="the island this executor belongs to (its own collectives and gang order; default 0)")
    parser.add_argument("--key-role", default="",
                        help="use this role's key pair instead of the id's: a spare key of the id (a replacement "
                             "started by pathways-run --max-executor-restarts)")
    parser.add_argument("--mmap-threshold-mb", type=float, default=DEFAULT_MMAP_THRESHOLD_MB,
                        help="glibc serves buffers of at least this many MiB with mappings of their own, returned "
                             "when freed (0: glibc's dynamic default; see executor/allocator.py)")
    parser.add_argument("--sim-count", type=int, default=None,
                        help="run this many simulated executors in this one process (--backend sim; --id gives one id "
                             "X, named X.0 .. X.<K-1>, or K comma-separated ids); see executor/sim_host.py")
    parser.add_argument("--checkpoint-root", default="pathways-checkpoints",
                        help="where service clients' checkpoints are written, each under DIR/<client name>/: the "
                             "controller's --checkpoint-root, the same storage at the same path (default: "
                             "pathways-checkpoints in the working directory)")
    args = parser.parse_args(argv)
    if args.sim_count is not None:
        from .sim_host import check_open_files, sim_ids

        try:   # before anything starts
            check_open_files(args.sim_count)
            sim_ids(args.id.split(","), args.sim_count)
        except ValueError as exc:
            parser.error(str(exc))
    return ExecutorConfig(controller_address=args.controller, executor_id=args.id, keys_dir=args.keys,
                          backend=args.backend,
                          device=args.device, bind_host=args.bind_host, num_threads=args.threads,
                          parent_pid=args.parent_pid, heartbeat_interval_s=args.heartbeat_interval_s,
                          heartbeat_timeout_s=args.heartbeat_timeout_s, join_timeout_s=args.join_timeout_s,
                          cpus=tuple(int(c) for c in args.cpus.split(",") if c.strip()), island=args.island,
                          key_role=args.key_role, mmap_threshold_mb=args.mmap_threshold_mb,
                          sim_count=args.sim_count or 0, checkpoint_root=os.path.abspath(args.checkpoint_root))


def main(argv=None) -> None:
    # First: a native crash writes every thread's stack to the executor's log; `kill -USR1 PID` too, for a hang.
    enable_crash_stacks()
    logging.basicConfig(level=os.environ.get("PATHWAYS_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    tune_allocator(config.mmap_threshold_mb)   # before torch is imported and allocates
    if config.cpus:
        # Before any thread starts (XLA's pool, gloo's, ZeroMQ's): threads inherit the mask.
        os.sched_setaffinity(0, config.cpus)
    # Ctrl-C in the client's terminal is the client's to handle: it stops us by message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if config.sim_count:
        from .sim_host import SimHost, sim_ids

        raise SystemExit(SimHost(config, sim_ids(config.executor_id.split(","), config.sim_count)).run())
    from .process import ExecutorProcess

    ExecutorProcess(config).run()


if __name__ == "__main__":
    main()
