"""`Dispatcher`: what functions, programs and arrays ask of their context, over the `ControllerClient`.

It registers each captured function and traced program once, dispatches calls and program runs, puts
tensors and fetches shards straight to and from the executors (`DataClient`), and frees dropped arrays
(batched, riding on the next message). It holds the client's caches; the controller holds none of its state.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref

from .array import Array
from .errors import PathwaysError, PlacementError, RemoteError
from .islands import check_collectives_in_islands
from .placement import Sharding, local_shape, normalize_placements, split_blocks
from .programs import ProgramGraph
from .wire import pb
from .wire import seam
from .wire.seam import CallSpec, ProgramSpec

__all__ = ["Dispatcher", "IDLE_FLUSH_BYTES", "explained"]

# Dropped arrays holding at least this much are freed when the client waits over 50 ms (`frees_worth_flushing`).
IDLE_FLUSH_BYTES = 1 << 20


class Dispatcher:
    """The call path of one `Context`: its functions, programs and arrays dispatch through it (each `Array` holds
    its dispatcher, never the context). ``debug``: the context's ``debug`` option (calls digest replicated
    outputs)."""

    def __init__(self, client, data, *, debug: bool = False):
        self._client, self._data, self._debug = client, data, debug
        self._closed = False                 # set by `close` (the context's): nothing more is dispatched
        self._batched = threading.local()    # see batched_release
        self._dropped_bytes = 0              # of arrays dropped since the last flush of frees
        self._function_ids: dict[int, tuple] = {}      # id(version) → (function id, weak reference to the version)
        self._lowered_programs: dict[int, tuple] = {}  # id(graph) → (program id, weak reference to the graph)
        # Functions whose captured versions and programs whose traced graphs are gone (the finalizer's thread may
        # be any, even one inside the controller): forgotten on the controller and executors at this client's
        # next call (`_forget_dead`).
        self._dead_functions: collections.deque = collections.deque()
        self._dead_programs: collections.deque = collections.deque()
        # Each executor's island, asked once: a call's collective check reads it for every member (two requests
        # of each OpByOp call before), and an executor id keeps its island (a replacement joins its predecessor's).
        self._islands: dict[str, str] = {}

    # ------------------------------------------------------------ open, closed, errors

    @property
    def closed(self) -> bool:
        """Whether its context closed (arrays not fetched before cannot be)."""
        return self._closed

    def close(self) -> None:
        self._closed = True

    def check_open(self) -> None:
        if self._closed:
            raise PathwaysError("this context is closed; create a new pw.Context")

    def explained(self, error: BaseException) -> BaseException:
        """``error`` as a future raises it (`explained`), with the user's line of the op it names."""
        return explained(error, self.user_line)

    # ------------------------------------------------------------ calls and programs

    def call(self, version, mesh, inputs, layouts: list, call_site: str, donated: tuple[int, ...] = ()) -> list[Array]:
        """Dispatch one call of a captured function on ``mesh``; its output arrays at once. ``donated``: the
        positions of ``inputs`` the call frees (the caller gave them up)."""
        self.check_open()
        self._forget_dead()
        check_collectives_in_islands(version, mesh.allocation, self._island_of)
        replicated = tuple(sharding.is_replicated for _, _, sharding, _ in layouts)
        spec = CallSpec(function_id=self._function_id(version), name=version.name, mesh=mesh.allocation,
                        inputs=tuple(a.array_id for a in inputs), num_outputs=len(layouts),
                        replicated_outputs=replicated, debug=self._debug, call_site=call_site,
                        collective_axes=version.collective_axes, report_shapes=version.data_dependent,
                        output_shard_bytes=_output_bytes(layouts), donated=donated)
        states = self._client.request(seam.Call(spec))
        for position in donated:
            inputs[position].mark_donated(version.name)
        return [Array(self, state, shape, dtype, sharding, block)
                for state, (shape, dtype, sharding, block) in zip(states, layouts)]

    def _island_of(self, executor_id: str) -> str:
        island = self._islands.get(executor_id)
        if island is None:
            island = self._islands[executor_id] = self._client.request(seam.IslandOf(executor_id))
        return island

    def run_program(self, graph, inputs) -> list[Array]:
        """Run a traced program (registered on first use) on ``inputs``; its output arrays at once."""
        self.check_open()
        self._forget_dead()
        states = self._client.request(seam.RunProgram(self._program_id(graph), [a.array_id for a in inputs]))
        return [Array(self, state, *graph.layouts[value])
                for state, value in zip(states, graph.output_values)]

    def lowered(self, program, *arrays) -> str:
        """The lowered form of ``program`` for these inputs, as text (registers it if new)."""
        graph = program.graph(*arrays)
        if not isinstance(graph, ProgramGraph):   # a sequential fallback: only its prefix is lowered
            prefix = graph.prefix
            return str(graph) + ("" if prefix is None else "\n" + self._describe(prefix))
        return self._describe(graph)

    def _describe(self, graph) -> str:
        program_id = self._program_id(graph)
        return self._client.request(seam.DescribeProgram(program_id)) + "\n" + self._fusion(program_id)

    def _fusion(self, program_id: int) -> str:
        """What each executor fused of the program (planned there at its first run: executor/fusion.py)."""
        lines = []
        for executor_id, reply in sorted(self._client.request(seam.Gather("stats")).items()):
            for text in reply.stats.fusion:
                # "program <name> (<id>) segment ...": the id is matched at its place before "segment", so a
                # name with parentheses of its own cannot match another program's.
                header, _, body = text.partition("\n")
                _, found, segment = header.partition(f" ({program_id}) segment ")
                if found:
                    lines.append(f"{executor_id}: segment {segment}")
                    lines.extend(f"  {line}" for line in body.splitlines())
        if not lines:
            return "fusion: not planned yet (each executor plans it at the program's first run)"
        return "\n".join(["fusion:"] + lines)

    def _register_program(self, graph) -> int:
        nodes = []
        for node in graph.nodes:
            check_collectives_in_islands(node.version, node.mesh.allocation, self._island_of)
            nodes.append(CallSpec(name=node.version.name, function_id=self._function_id(node.version),
                                  mesh=node.mesh.allocation, inputs=node.inputs, outputs=node.outputs,
                                  collective_axes=node.version.collective_axes,
                                  replicated_outputs=tuple(layout[2].is_replicated for layout in node.layouts),
                                  debug=self._debug,
                                  output_shard_bytes=_output_bytes(node.layouts)))
        spec = ProgramSpec(name=graph.name, input_values=graph.input_values,
                           input_meshes=tuple(graph.layouts[v][2].mesh.allocation for v in graph.input_values),
                           nodes=tuple(nodes), output_values=graph.output_values)
        return self._client.request(seam.RegisterProgram(spec))

    def _program_id(self, graph) -> int:
        """The id of a traced graph's lowered, registered form (registered on first use)."""
        entry = self._lowered_programs.get(id(graph))
        if entry is None or entry[1]() is not graph:   # ids of dead graphs can be reused
            program_id = self._register_program(graph)
            entry = self._lowered_programs[id(graph)] = (program_id, weakref.ref(graph))
            weakref.finalize(graph, self._program_died, id(graph), program_id)
        return entry[0]

    def _program_died(self, key: int, program_id: int) -> None:
        """A traced graph was collected: its program is never run again (any thread; only noted here)."""
        _died(self._lowered_programs, key, program_id, self._dead_programs)

    def _function_died(self, key: int, function_id: int) -> None:
        """A captured version was collected (its `pw.function` was): it is never called again (any thread)."""
        _died(self._function_ids, key, function_id, self._dead_functions)

    def _forget_dead(self) -> None:
        """Let the functions of collected versions and the programs of collected graphs go, on the controller and
        every executor that holds them (a thousand executors each hold a plan of every program registered;
        docs/scale.md). Their calls in flight end first (the controller waits for them)."""
        if not (self._dead_functions or self._dead_programs) or self._closed:
            return
        self._client.request(seam.Forget(_drain(self._dead_functions), _drain(self._dead_programs)))

    def _function_id(self, version) -> int:
        entry = self._function_ids.get(id(version))
        if entry is None or entry[1]() is not version:   # ids of dead versions can be reused
            function_id = self._client.request(seam.RegisterFunction(version.name, version.graph,
                                                                     list(version.constants), version.sim_seconds))
            entry = self._function_ids[id(version)] = (function_id, weakref.ref(version))
            weakref.finalize(version, self._function_died, id(version), function_id)
        return entry[0]

    def user_line(self, function_id: int, node_index: int) -> str:
        """The user's source line of node ``node_index`` of a registered function ("" if unknown)."""
        for known_id, version_ref in list(self._function_ids.values()):
            version = version_ref()
            if known_id == function_id and version is not None:
                return version.user_line(node_index)
        return ""

    # ------------------------------------------------------------ bytes to and from the executors

    def put_many(self, items: list, mesh) -> list[Array]:
        """Place several ``(tensor, placements)`` on ``mesh`` with one message per executor."""
        import torch

        arrays, shards_by_position = [], [[] for _ in range(mesh.size)]
        for tensor, placements in items:
            if not isinstance(tensor, torch.Tensor):
                raise PlacementError(f"ctx.put: expected a torch.Tensor, got {type(tensor).__name__}")
            placements = normalize_placements(placements, mesh)
            block_shape = local_shape(tuple(tensor.shape), placements, mesh)
            # One private copy, so later in-place changes to `tensor` cannot race the send.
            blocks = [b.detach().to("cpu", copy=True).contiguous() for b in split_blocks(tensor, placements, mesh)]
            state = self._new_array(mesh, arrays, max(b.numel() * b.element_size() for b in blocks))
            for position, block in enumerate(blocks):
                shards_by_position[position].append((pb.ShardRef(array_id=state.array_id, shard=position), block,
                                                     state.put_token))
            arrays.append(Array(self, state, tuple(tensor.shape), tensor.dtype, Sharding(mesh, placements),
                                block_shape))
        client = self._client
        for executor_id, shards in zip(mesh.executor_ids, shards_by_position):
            for message in _messages(shards):
                ids = [ref.array_id for ref, _, _ in message]
                self._data.put(executor_id, message,
                               lambda error, ids=ids: [client.request(seam.Landed(i, error)) for i in ids])
        return arrays

    def _new_array(self, mesh, made: list[Array], shard_bytes: int):
        """A put's array (it may wait for executor memory, and fail with `OutOfMemoryError`). If it fails, the
        arrays ``made`` before it in the same put are never put: their shards are marked as never landing, so
        dropping them frees them."""
        try:
            [state] = self._client.request(seam.NewArray(mesh.executor_ids, mesh.size, shard_bytes))
            return state
        except BaseException as exc:
            for array in made:
                for _ in range(mesh.size):
                    self._client.request(seam.Landed(array.array_id, exc))
            raise

    def fetch_blocks(self, array: Array, positions: list[int], lost: tuple[str, ...],
                     timeout_s: float | None) -> dict:
        """The blocks at ``positions`` of a computed array, straight from their executors."""
        ids = array.mesh.executor_ids
        if lost:   # a replicated array that lost replicas: every block comes from a replica that is left
            live = next(p for p, e in enumerate(ids) if e not in lost)
            block = self._data.fetch(ids[live], pb.ShardRef(array_id=array.array_id, shard=live))
            return {p: block.result(timeout_s) for p in positions}
        futures = {p: self._data.fetch(ids[p], pb.ShardRef(array_id=array.array_id, shard=p)) for p in positions}
        return {p: f.result(timeout_s) for p, f in futures.items()}

    def save_shards(self, executor_id: str, refs: list, names: list[str], path: str):
        """Have ``executor_id`` write its shards ``refs`` (as ``names``) to the file ``path`` once they are ready;
        a future of the bytes written (no tensor bytes come to the client)."""
        return self._data.save(executor_id, refs, names, path)

    # ------------------------------------------------------------ frees

    def release(self, array_id: int, nbytes: int = 0) -> None:
        """An array (of ``nbytes``) was dropped: free its shards (with this thread's batch, if one is open)."""
        if self._closed:
            return
        self._dropped_bytes += nbytes   # from any thread (a finalizer): a lost update only delays an idle flush
        batch = getattr(self._batched, "ids", None)
        if batch is not None:
            batch.append(array_id)
        else:
            self._client.request(seam.Release(array_id))

    def flush_frees(self) -> None:
        """Send the frees still waiting for a message to ride on (the client is about to idle)."""
        self._dropped_bytes = 0
        if not self._closed:
            self._forget_dead()
            self._client.request(seam.FlushFrees())

    def frees_worth_flushing(self) -> bool:
        """Whether a client that waits a while should send the frees now: the arrays dropped since the last flush
        hold at least ``IDLE_FLUSH_BYTES``, which executors should let go of meanwhile. Smaller ones wait for the
        next message to their executors: a flush is a Free to every executor with one pending (at 1,024 executors,
        1,024 messages to give back a few bytes each; docs/scale.md)."""
        return self._dropped_bytes >= IDLE_FLUSH_BYTES

    @contextlib.contextmanager
    def batched_release(self):
        """Arrays this thread drops inside are freed together: one Free per executor."""
        if getattr(self._batched, "ids", None) is not None:   # nested: the outer scope frees
            yield
            return
        self._batched.ids = []
        try:
            yield
        finally:
            ids, self._batched.ids = self._batched.ids, None
            if ids and not self._closed:
                self._client.request(seam.ReleaseMany(ids))

    def note_runahead_wait(self, start_ns: int, in_flight: int, what: str) -> None:
        """Keep a wait at the run-ahead bound for the trace (the controller keeps its own the same way)."""
        self._client.request(seam.NoteRunaheadWait(start_ns, time.time_ns(), in_flight, what))


def explained(error: BaseException, user_line=None) -> BaseException:
    """``error``, with the user's line of the op a backend could not compile when it names one (``user_line``:
    function id, node index -> that line), and no traceback: the same object is raised by every future it failed,
    and the controller keeps it, so each raise would add its frames (and their locals: arrays, losses) to one
    traceback that lives as long as the run."""
    if user_line is not None and isinstance(error, RemoteError) and error.node_index and not error.user_line:
        error.locate(user_line)
    error.__traceback__ = None
    return error


# A put's shards travel in messages of about this many bytes at most (one shard bigger than it: alone). An executor
# copies each received frame once (its bytes are not aligned for torch's kernels) and frees a message only once
# it has taken all of it: a training state put whole would briefly take twice its size there.
_PUT_MESSAGE_BYTES = 8 << 20


def _messages(shards: list) -> list[list]:
    """``shards`` ((ref, block, token) in order) cut into consecutive messages of `_PUT_MESSAGE_BYTES` at most."""
    messages, current, size = [], [], 0
    for shard in shards:
        nbytes = shard[1].numel() * shard[1].element_size()
        if current and size + nbytes > _PUT_MESSAGE_BYTES:
            messages.append(current)
            current, size = [], 0
        current.append(shard)
        size += nbytes
    if current:
        messages.append(current)
    return messages


def _output_bytes(layouts) -> tuple[int, ...]:
    """The bytes of one shard of each output of ``layouts`` ((shape, dtype, sharding, block) each): the block's
    elements times its dtype's size, 0 when a size depends on the data (unknown). For the controller's memory
    budget (controller/memory.py)."""
    sizes = []
    for _, dtype, _, block in layouts:
        count = 1
        for size in block:
            if size is None:
                count = 0
                break
            count *= size
        sizes.append(count * getattr(dtype, "itemsize", 0))
    return tuple(sizes)


def _died(registered: dict, key: int, registered_id: int, dead: collections.deque) -> None:
    """``registered[key]`` (an id and a weak reference) names a collected object: drop it (unless the key was
    reused meanwhile) and note ``registered_id`` in ``dead``, to be forgotten at the next call."""
    entry = registered.get(key)
    if entry is not None and entry[0] == registered_id:
        del registered[key]
    dead.append(registered_id)


def _drain(dead: collections.deque) -> list:
    taken = []
    while dead:
        taken.append(dead.popleft())
    return taken
