"""The one place tests and benchmarks reach the parts behind a `pw.Context` (issue 48: no test-only surface on a
public class). `pw.Context` offers users meshes, puts, training, stats and traces; what stands behind it — the
embedded controller, its server, the data client, the keys, the local executor processes — is the context's
`Session`'s, and these functions read it there. Prefer what `ctx.stats()`, `ctx.is_lost(...)` and the other public
methods already return; reach for these only to look at (or stand in for) a part no public method shows.

Benchmarks import these too (``from tests.handles import controller_of``): one implementation for both.
"""

from __future__ import annotations

__all__ = ["client_of", "controller_of", "server_of", "data_client_of", "client_credentials_of", "keys_of",
           "cluster_of", "dispatcher_of", "swap_client"]


def client_of(ctx):
    """The `ControllerClient` the context's session speaks to the controller through: an `InProcessClient` for
    the embedded controller, a `RemoteClient` for a `pathways-controller` service."""
    return ctx._session.client


def controller_of(ctx):
    """The embedded controller itself (``controller.Controller``): its tables (``resources``, ``arrays``,
    ``groups``, ``rendezvous`` ...) and counters. An embedded context's only (a remote client has none here)."""
    return client_of(ctx).controller


def server_of(ctx):
    """The embedded controller's `ControllerServer`: its address, credentials, connections and sockets."""
    return client_of(ctx).server


def data_client_of(ctx):
    """The context's `DataClient`: tensor bytes straight to and from the executors (puts, fetches, saves)."""
    return ctx._session.data


def client_credentials_of(ctx):
    """The CURVE credentials this client connects to the executors with (its data client's)."""
    return data_client_of(ctx)._credentials


def keys_of(ctx):
    """The context's `KeyDirectory`: the key pairs made for it (or a launch's, or a service client's folder)."""
    return ctx._session.keys


def cluster_of(ctx):
    """The `LocalCluster` of executor processes an embedded context started (None when it started none)."""
    return ctx._session.cluster


def dispatcher_of(ctx):
    """The context's `Dispatcher`: the call path of functions, programs and arrays (what it registered, lowered)."""
    return ctx._dispatch


def swap_client(ctx, client):
    """Put ``client`` where the context and its dispatcher send their requests (a benchmark that counts them wraps
    the real one); return the client that was there, to put back the same way."""
    old = ctx._client
    ctx._client = ctx._dispatch._client = client
    return old
