"""The run's key pairs, one folder per host: ``pathways-run --make-keys DIR --nnodes N --nproc-per-node P``.

Every connection of a run speaks CURVE and admits only allow-listed keys
(`pathways_torch.wire.security`). The launcher makes every pair once, on one machine, and
writes one folder per node holding only what that node needs — its own executors' key
pairs, node 0's also the controller's and the client's — and every public key (the
allow-list). The user's scheduler distributes the folders (a Kubernetes Secret per node, a
SLURM job folder readable only by the user); no key travels over the network in clear.

    DIR/              0700
      node-0/         0700  a key directory: public/ every role's .key; secret/ controller, client,
                            executor-0 .. executor-(P-1), and each one's spares executor-K.r1 .. .r3
      node-1/         0700  public/ the same; secret/ executor-P .. executor-(2P-1) and their spares
      ...
"""

from __future__ import annotations

import os
import shutil

from ..wire.security import CLIENT, CONTROLLER, KeyDirectory, SecurityError, spare_of, spare_role
from .environment import executor_ids

__all__ = ["make_run_keys", "node_folder", "roles_of_node", "spare_role", "spare_of", "SPARES"]

# Spare key pairs per executor: a replacement started by pathways-run on the executor's node uses the next one,
# and the controller revokes the one before it (docs/faults.md). Made with the run's keys: no key travels later.
SPARES = 3


def roles_of_node(node: int, nproc_per_node: int, spares: int = 0) -> list[str]:
    """The roles whose secret keys node ``node`` holds (its executors' and, with ``spares``, their spares')."""
    own = executor_ids(range(node * nproc_per_node, (node + 1) * nproc_per_node))
    own += [spare_role(e, n) for e in list(own) for n in range(1, spares + 1)]
    return [CONTROLLER, CLIENT, *own] if node == 0 else own


def node_folder(keys_dir: str, node: int) -> str:
    return os.path.join(keys_dir, f"node-{node}")


def make_run_keys(keys_dir: str, nnodes: int, nproc_per_node: int) -> list[str]:
    """Write the run's folders under ``keys_dir`` (new or empty); return them, node by node."""
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"--make-keys: expected --nnodes >= 1 and an integer --nproc-per-node >= 1, got "
                         f"{nnodes} and {nproc_per_node}")
    if os.path.exists(keys_dir) and os.listdir(keys_dir):
        raise SecurityError(f"--make-keys {keys_dir}: expected a new or empty folder, it holds "
                            f"{sorted(os.listdir(keys_dir))[:5]}; keys of one run are made once: pick a new folder")
    os.makedirs(keys_dir, mode=0o700, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    executors = executor_ids(range(nnodes * nproc_per_node))
    roles = [CONTROLLER, CLIENT, *executors, *[spare_role(e, n) for e in executors for n in range(1, SPARES + 1)]]
    every = KeyDirectory.create(roles, parent=keys_dir)     # one scratch folder with every pair, removed below
    try:
        folders = [_write_node(every, keys_dir, node, nproc_per_node) for node in range(nnodes)]
    finally:
        every.remove()
    return folders


def _write_node(every: KeyDirectory, keys_dir: str, node: int, nproc_per_node: int) -> str:
    folder = node_folder(keys_dir, node)
    for sub in ("", "public", "secret"):
        os.makedirs(os.path.join(folder, sub), mode=0o700, exist_ok=True)
    for name in os.listdir(os.path.join(every.path, "public")):
        target = os.path.join(folder, "public", name)
        shutil.copyfile(os.path.join(every.path, "public", name), target)
        os.chmod(target, 0o600)
    for role in roles_of_node(node, nproc_per_node, SPARES):
        target = os.path.join(folder, "secret", f"{role}.key_secret")
        shutil.copyfile(os.path.join(every.path, "secret", f"{role}.key_secret"), target)
        os.chmod(target, 0o600)
    KeyDirectory(folder)        # checks the modes it will be read with
    return folder
