"""The service fuzzer's inputs (`bench.fuzz_service`): seam_codec requests ``{"r": id, "op": name, "a": [args]}`` a
hostile client sends on its own key, for every op the client socket serves and some it does not.

Arguments are drawn by the op's signature (the ``FIELD_TYPES`` of `pathways_torch.wire.seam.OPS`, read at run time,
so an op added there is fuzzed without a change here) from pools that mix edge values (NaN, inf, 1e308, -0.0,
5e-324, huge ints, wrong types) with real ones: the sender's own functions, meshes, arrays and granted ids (so a
request gets past the ownership checks to the code behind them) and the other client's array ids and small guessed
ids. Then a share of them is mutated: on the JSON tree (a node replaced by a wrong type, a bad tag, a deep nest, a
`$c` with bad fields, a `$pb` of garbage, an `$e`) or on the bytes (truncated, flipped, frames added or dropped). A
few are large: up to the service's message cap and a few over it.
"""

from __future__ import annotations

import dataclasses
import json
import math

from pathways_torch import errors
from pathways_torch.wire import pb, seam_codec
from pathways_torch.wire.seam import CallSpec, MeshAllocation, ProgramSpec

__all__ = ["Pools", "Input", "OPS", "UNKNOWN_OPS", "request", "junk", "big", "HAZARDS", "readable_r", "encode", "ends_session"]

UNKNOWN_OPS = ("", "PING", "__init__", "_handle", "disconnect", "release_everything", "forget_everything", "x" * 300,
               "close", "admin", "set_weight", "\x00")
_FLOATS = (0.0, -0.0, 5e-324, 1e-7, 0.5, 1.0, 1e6, 1e308, math.inf, -math.inf, math.nan, -1.0)
_SMALL_SECONDS = (0.0, -0.0, 5e-324, 0.001, 0.05, -1.0, 0, -5)   # for ops that wait (no parking: see HAZARDS)
_WAITS = ("wait_for_executors", "replace_executor")
_EDGE_INTS = (0, -1, 1, 2, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 10**300)
_STRINGS = ("", "stats", "trace", "x" * 300, "\x00", "é", "../../etc/passwd", "executor-99", "controller", "client",
            "client-alice", "alice")
_ERRORS = (ValueError("fuzz"), TypeError(), KeyError("k"), errors.ExecutorLostError("executor-0 fuzzed"),
           errors.RemoteError("fuzz"), errors.OutOfMemoryError("fuzz"), errors.ControllerLostError("fuzz"))


@dataclasses.dataclass
class Pools:
    """What the hostile client knows: its own live ids (updated from the service's answers), the executors, and
    the other client's array ids (read from its arrays: a shared trace would show them)."""

    executor_ids: tuple[str, ...] = ()
    functions: list = dataclasses.field(default_factory=list)    # function ids it registered
    programs: list = dataclasses.field(default_factory=list)
    meshes: list = dataclasses.field(default_factory=list)       # MeshAllocations it allocated
    arrays: list = dataclasses.field(default_factory=list)       # array ids it holds
    grants: list = dataclasses.field(default_factory=list)       # [next, end] blocks of granted ids, in order
    graphs: list = dataclasses.field(default_factory=list)       # real graphs (a legit session's)
    calls: list = dataclasses.field(default_factory=list)        # real CallSpecs (a legit session's)
    others: tuple[int, ...] = ()                                  # the other client's array ids
    cap_bytes: int = 8 << 20

    def ints(self) -> tuple:
        own = tuple(self.functions[-4:]) + tuple(self.programs[-4:]) + tuple(self.arrays[-8:])
        return own + self.others + tuple(range(0, 12)) + _EDGE_INTS

    def next_ids(self, count: int) -> list[int]:
        """The next ``count`` of its granted ids (what the service expects a call's output ids to be)."""
        ids = []
        while len(ids) < count and self.grants:
            start, end = self.grants[0]
            if start >= end:
                self.grants.pop(0)
                continue
            ids.append(start)
            self.grants[0][0] = start + 1
        return ids

    def resync(self, expected_next: int | None) -> None:
        """The service said which granted id it expects next: skip the model's grants up to it."""
        while self.grants and not (expected_next is not None and self.grants[0][0] <= expected_next
                                   < self.grants[0][1]):
            self.grants.pop(0)
        if self.grants:
            self.grants[0][0] = expected_next


@dataclasses.dataclass
class Input:
    """One message: the frames sent, the op (or a name for a message that is no request), the request id the
    service should answer (0: none), and whether it decodes at all (this side runs the service's decoder)."""

    op: str
    frames: list
    r: int = 0
    note: str = ""
    clean: bool = False   # made by the seam's encoder and not bent since: the service reads r as sent


def encode(message) -> list:
    return [bytes(f) for f in seam_codec.encode(message)]


def readable_r(frames: list) -> int | None:
    """The request id the service reads in ``frames`` (`seam_codec.decode`, then its r, op and a); None if it
    cannot read them as a request or r is no int."""
    try:
        message = seam_codec.decode(frames)
        r, _, _ = message["r"], message["op"], list(message.get("a", []))
    except Exception:   # noqa: BLE001 - whatever the service's decoder would refuse
        return None
    return r if isinstance(r, int) and not isinstance(r, bool) else None


def ends_session(frames: list) -> bool:
    """Whether the service reads ``frames`` as a ``bye`` it serves (after which it hears this connection no more)."""
    try:
        message = seam_codec.decode(frames)
        return message["op"] == "bye" and list(message.get("a", [])) == []
    except Exception:   # noqa: BLE001
        return False


# ------------------------------------------------------------ arguments by type

def _value_of(c, t, pools: Pools, op: str):
    """One value of type ``t`` (a class of a signature), drawn from its pool."""
    if t is bool:
        return c.choice((True, False))
    if t is int:
        return c.choice(pools.ints())
    if t is float:
        return c.choice(_SMALL_SECONDS if op in _WAITS else _FLOATS)
    if t is str:
        return c.choice(pools.executor_ids + _STRINGS)
    if t in (list, tuple):
        return _sequence(c, pools)
    if t is dict:
        return c.choice(({"data": len(pools.executor_ids)}, {"data": 1}, {"data": 0}, {"x": -1}, {"": 2**63},
                         {"data": 1.5}, {}, {str(i): 1 for i in range(40)}, {"data": math.nan}, {1: 2}))
    if t is type(None):
        return None
    if isinstance(t, type) and issubclass(t, BaseException):
        return c.choice(_ERRORS)
    if t is pb.Graph:
        return graph(c, pools)
    if t is CallSpec:
        return call_spec(c, pools)
    if t is ProgramSpec:
        return program_spec(c, pools)
    return c.choice(pools.ints())


def _sequence(c, pools: Pools):
    how = c.integer(0, 3) if c.integer(0, 9) else c.choice((4, 5, 5))   # long lists: 1 in 30 (costly to code)
    if how == 0:
        return []
    if how == 1:
        return list(pools.executor_ids[:c.integer(0, len(pools.executor_ids))])
    if how == 2:
        return [c.choice(pools.ints()) for _ in range(c.integer(1, 6))]
    if how == 3:
        return [c.choice(pools.others or (1,)) for _ in range(c.integer(1, 3))]   # the other client's
    if how == 4:
        return list(range(c.choice((1000, 20000))))
    return [c.choice((None, "x", 1.5, [], {}, True)) for _ in range(c.integer(1, 3))]


def _arg(c, signature_type, pools: Pools, op: str):
    choices = signature_type if isinstance(signature_type, tuple) else (signature_type,)
    return _value_of(c, c.choice(choices), pools, op)


def graph(c, pools: Pools) -> pb.Graph:
    """A legit session's graph, or one with a field changed, or an empty or random one."""
    how = c.integer(0, 4)
    if pools.graphs and how <= 2:
        copy = pb.Graph()
        copy.CopyFrom(c.choice(pools.graphs))
        if how == 1 and copy.nodes:
            node = c.choice(list(copy.nodes))
            node.target = c.choice(("aten._assert_async.msg", "os.system", "builtins.eval", "aten.ones.default",
                                    "aten.add.Tensor", "", "aten.x.y"))
        elif how == 2 and copy.inputs:
            meta = c.choice(list(copy.inputs))
            del meta.shape[:]
            meta.shape.extend(c.choice(((), (0,), (2**40,), (2**31, 2**31), (3, 5))))
        return copy
    if how == 3:
        return pb.Graph()
    nodes = [pb.GraphNode(op="placeholder", name="x"),
             pb.GraphNode(op="call_function", target=c.choice(("aten.ones.default", "aten.full.default",
                                                                 "aten.add.Tensor", "os.system")), name="y",
                          args=[pb.Arg(list=pb.ArgList(items=[pb.Arg(int_value=c.choice((4, 0, -1, 2**40)))]))]),
             pb.GraphNode(op="output", args=[pb.Arg(node=c.choice((1, 0, 7, 2**32 - 1)))])]
    return pb.Graph(nodes=nodes)


def mesh(c, pools: Pools) -> MeshAllocation:
    """Its own mesh mostly; else a guess at the other client's (a small id, every executor) or a bent one."""
    ids = pools.executor_ids
    how = c.integer(0, 5)
    if pools.meshes and how <= 2:
        return c.choice(pools.meshes)
    if how == 3:
        return MeshAllocation(c.integer(0, 8), (("data", len(ids)),), ids)
    return MeshAllocation(c.choice(pools.ints()), c.choice(((("data", -1),), (), (("data", 2**63),))),
                          c.choice((ids, (), ("executor-99",), ids + ids)))


def call_spec(c, pools: Pools, *, outputs: tuple = ()) -> CallSpec:
    """A call of its own function on its own mesh mostly, some fields then bent."""
    base = c.choice(pools.calls) if pools.calls else CallSpec(function_id=1, name="f", mesh=mesh(c, pools),
                                                              inputs=(1,), num_outputs=1)
    spec = dataclasses.replace(
        base, function_id=c.choice(tuple(pools.functions[-3:]) * 3 + pools.ints()) if pools.functions
        else c.choice(pools.ints()), mesh=mesh(c, pools), outputs=outputs,
        num_outputs=len(outputs) if outputs else base.num_outputs,
        inputs=tuple(c.choice(tuple(pools.arrays[-4:]) * 3 + pools.ints()) for _ in range(len(base.inputs))))
    bend = c.integer(0, 12)
    if bend == 0:
        spec = dataclasses.replace(spec, num_outputs=c.choice((0, -1, 2, 10**6, 2**63)))
    elif bend == 1:
        spec = dataclasses.replace(spec, output_shard_bytes=(c.choice((-1, 2**63, 10**30, 0)),))
    elif bend == 2:
        spec = dataclasses.replace(spec, donated=(c.choice((0, -1, 5, 2**63)),))
    elif bend == 3:
        spec = dataclasses.replace(spec, collective_axes=(c.choice(("data", "x", "")),), debug=True)
    elif bend == 4:
        spec = dataclasses.replace(spec, output_positions=(c.choice((0, -1, 99)),), report_shapes=True)
    elif bend == 5:
        spec = dataclasses.replace(spec, replicated_outputs=(True,) * c.choice((1, 0, 5)))
    elif bend == 6:
        spec = dataclasses.replace(spec, inputs=tuple(c.choice(pools.others or (1,)) for _ in spec.inputs))
    return spec


def program_spec(c, pools: Pools) -> ProgramSpec:
    """A one-node program of its own function, or a bent one: many nodes (past the node cap), cycles, odd ids."""
    nodes_count = c.choice((1, 1, 1, 2, 0, 5000))
    nodes = tuple(call_spec(c, pools, outputs=(i + 1,)) for i in range(min(nodes_count, 50)))
    if nodes_count > 50 and nodes:   # a large program: one node, repeated (cheap to make, as big to lower)
        nodes = tuple(dataclasses.replace(nodes[0], inputs=(i,), outputs=(i + 1,)) for i in range(nodes_count))
    nodes = tuple(dataclasses.replace(n, inputs=(i,) * len(n.inputs)) for i, n in enumerate(nodes))
    cyclic = c.integer(0, 6) == 0
    if cyclic and nodes:
        nodes = (dataclasses.replace(nodes[0], inputs=(len(nodes),) * len(nodes[0].inputs)),) + nodes[1:]
    return ProgramSpec(name=c.choice(("p", "", "x" * 300)), input_values=(0,), input_meshes=(mesh(c, pools),),
                       nodes=nodes, output_values=c.choice(((len(nodes),), (), (99,), (2**63,))))


def _args(c, op: str, signature: tuple, pools: Pools) -> list:
    """Arguments for ``op``: its own ids where the op names them; the right count mostly, else one more or less."""
    args = [_arg(c, t, pools, op) for t in signature]
    if op in _WAITS and len(args) == 2:   # a wait's seconds: short ones here (long, inf, NaN: HAZARDS)
        args[1] = c.choice(_SMALL_SECONDS)
    if op == "call" and isinstance(args[0], CallSpec) and c.integer(0, 3):
        args[1] = pools.next_ids(max(0, min(args[0].num_outputs or 0, 8)))
    elif op == "run_program" and pools.programs and c.integer(0, 2):
        args[0] = c.choice(pools.programs)
        args[1] = [c.choice(pools.arrays or [1])]
        args[2] = c.choice((None, pools.next_ids(1)))
    elif op in ("release", "landed") and pools.arrays and c.integer(0, 2):
        args[0] = c.choice(pools.arrays)
    elif op == "new_array" and c.integer(0, 2):
        args = [list(pools.executor_ids), c.choice((0, 1, -1, 2**63)), c.choice((0, 8, 2**63, -1, 10**30))]
    count = c.integer(0, 15)
    if count == 0 and args:
        args.pop()
    elif count == 1:
        args.append(c.choice((None, 1, "x")))
    return args


def request(c, op: str, signature: tuple | None, pools: Pools, r: int) -> Input:
    """A request of ``op`` (``signature``: its argument types; None for an op the service does not serve)."""
    args = _args(c, op, signature, pools) if signature is not None else \
        [c.choice(pools.ints()) for _ in range(c.integer(0, 2))]
    try:
        frames = encode({"r": r, "op": op, "a": args})
    except seam_codec.SeamCodecError as exc:   # a value this codec cannot carry (a huge int nests fine)
        frames = encode({"r": r, "op": op, "a": []})
        return Input(op, frames, r, f"unencodable: {exc}", clean=True)
    return Input(op, frames, r, clean=True)


# ------------------------------------------------------------ mutations and junk

def mutate(c, item: Input) -> Input:
    """``item`` with its JSON tree or its bytes bent (the request id stays, where the tree still has one)."""
    how = c.integer(0, 9)
    frames = list(item.frames)
    if how <= 4:
        tree = json.loads(frames[0])
        tree, note, nest = _bend_tree(c, tree, frames)
        text = json.dumps(tree, separators=(",", ":"), allow_nan=True)
        frames[0] = (text.replace(json.dumps(_NEST), nest) if nest else text).encode()
        return Input(item.op, frames, item.r, note)
    data = frames[0]
    if how == 5:
        frames[0] = data[:c.integer(0, max(0, len(data) - 1))]
        note = "truncated JSON"
    elif how == 6 and data:
        at = c.integer(0, len(data) - 1)
        frames[0] = data[:at] + bytes([data[at] ^ (1 << c.integer(0, 7))]) + data[at + 1:]
        note = "a bit flipped"
    elif how == 7:
        frames.append(c.raw(c.integer(0, 64)))
        note = "an extra frame"
    elif how == 8 and len(frames) > 1:
        frames.pop()
        note = "a frame missing"
    else:
        frames[0] = c.raw(c.integer(1, 64))
        note = "random bytes for JSON"
    return Input(item.op, frames, item.r, note)


_NUMBERS = ("NaN", "Infinity", "-Infinity", "1e999", "-0.0", "5e-324", "1e308", str(2**64), "9" * 4000)


_NEST = "\u0001nest\u0001"   # where a deep nest goes in the JSON text (too deep for json.dumps to write)


def _bend_tree(c, tree, frames: list):
    """A node of the request's tree (its arguments, or r, op, a) replaced by something wrong; and the JSON text of
    a deep nest, if that is what replaces it."""
    pairs = tree.get("$d") if isinstance(tree, dict) else None
    if not isinstance(pairs, list):
        return tree, "not a request", None
    fields = {p[0]: p for p in pairs if isinstance(p, list) and len(p) == 2}
    where = c.choice(("r", "op", "a", "a", "a", "a", "extra", "tag"))
    nest = None
    if c.integer(0, 12) == 0:
        depth, kind = c.choice((seam_codec.MAX_DEPTH + 1, 500, 5000)), c.choice(("list", "tuple"))
        value, nest = _NEST, _nest(depth, kind)
    else:
        value = _bad_node(c, frames)
    if where == "a" and "a" in fields and isinstance(fields["a"][1], list) and fields["a"][1]:
        fields["a"][1][c.integer(0, len(fields["a"][1]) - 1)] = value
    elif where == "extra":
        pairs.append(["zz", value])
    elif where == "tag":   # the request's own node: another key beside $d
        tree["$t"] = value
    elif where in fields:
        fields[where][1] = value
    else:
        pairs.append([where, value])
    shown = nest[:40] + f"... ({len(nest):,} chars)" if nest else json.dumps(value, allow_nan=True)[:60]
    return tree, f"{where} := {shown}", nest


def _bad_node(c, frames: list):
    how = c.integer(0, 12)
    if how == 0:
        return c.choice((math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324, 2**64, -(2**63) - 1, 10**100))
    if how == 1:
        return c.choice((None, True, "x", [], {}, [[1]], -1))
    if how == 2:
        return c.choice(([[[[]]]], {"$t": [{"$t": [{"$t": []}]}]}))
    if how == 3:
        return {"$c": c.choice(("CallSpec", "ProgramSpec", "MeshAllocation", "ExecutorView", "ArraySettled",
                                "ControllerCounters", "Popen", "object", "")),
                "f": c.choice(({}, {"zz": 1}, {"function_id": "x", "name": 1, "mesh": 3, "inputs": 5}, [],
                               {"mesh_id": math.nan, "axes": 1, "executor_ids": None}))}
    if how == 4:
        frames.append(c.raw(c.integer(0, 64)))
        return {"$pb": c.choice(("Graph", "Envelope", "StatusReply", "DESCRIPTOR", "__class__", "Arg")),
                "b": c.choice((len(frames) - 2, -1, 99, "0", None))}
    if how == 5:
        return {"$e": c.choice(("ExecutorLostError", "ValueError", "SystemExit", "KeyboardInterrupt", "OSError", "")),
                "a": c.choice(([], [1, "x"], "notalist", [[1]])), "v": c.choice(({}, {"__class__": 1}, [],
                                                                                   {"executor_id": [1]}))}
    if how == 6:
        return {"$b": c.choice((-1, 0, 5, -2, "0", 1.5, 2**64))}
    if how == 7:
        return {"$d": c.choice(([[1, 2]], [[[1], 2]], [[1]], "x", [[{"$t": []}, 1]], [[None, None]] * 3))}
    if how == 8:
        return {"$t": c.choice(([], [1, 2], "x", {}))}
    if how == 9:
        return {"$q": 1, "$t": [], "x": 2, "y": 3, "z": 4}
    return c.choice(("", 0, -1, 2**63, [0] * 100, {"$t": [{"$t": [1]}]}, "\ud800"))


def _nest(depth: int, kind: str) -> str:
    """JSON text of a list (or tagged tuple) nested ``depth`` deep."""
    if kind == "list":
        return "[" * depth + "0" + "]" * depth
    return '{"$t":[' * depth + "0" + "]}" * depth


def junk(c, r: int) -> Input:
    """A message that is no request, or barely one: raw bytes, JSON of another shape, numbers JSON cannot hold."""
    how = c.integer(0, 7)
    if how == 0:
        return Input("<raw bytes>", [c.raw(c.integer(0, 200))])
    if how == 1:
        return Input("<empty frames>", [b""] * c.integer(1, 3))
    if how == 2:
        return Input("<JSON not a request>", [c.choice((b"[]", b"1", b'"x"', b"null", b"{}", b'{"r":1}',
                                                        b'{"op":"ping"}', b'{"$d":[["r",1]]}',
                                                        b'{"$d":[["op","ping"]]}',
                                                        b'{"$d":[["r",7],["op","ping"],["a",{"$d":[]}]]}',
                                                        b'{"$d":[["r",7],["op",["ping"]],["a",[]]]}'))])
    if how == 3:
        number = c.choice(_NUMBERS)
        op = c.choice(("grant_ids", "wait_for_executors", "register_function", "release"))
        return Input("<odd number>", [f'{{"$d":[["r",{r}],["op","{op}"],["a",[{number},{number}]]]}}'.encode()], r)
    if how == 4:
        odd = c.choice(_NUMBERS + ("-1", "true", "[1]", '"1"', "null"))
        return Input("<odd r>", [f'{{"$d":[["r",{odd}],["op","counters"],["a",[]]]}}'.encode()])
    if how == 5:
        depth = c.choice((seam_codec.MAX_DEPTH + 1, 2000, 200_000))
        return Input("<deep nesting>", [f'{{"$d":[["r",{r}],["op","release_many"],["a",[{_nest(depth, "list")}]]]}}'
                                        .encode()], r)
    if how == 6:
        return Input("<invalid UTF-8>", [b'{"$d":[["r",1],["op","\xff\xfe"],["a",[]]]}'])
    return Input("<duplicate keys>", [f'{{"$d":[["r",{r}],["op","ping"],["op","bye"],["a",[]],["a",[1]]]}}'
                                      .encode()], r)


def big(c, pools: Pools, r: int) -> Input:
    """A large message: up to the cap and a few over it, as bytes (a constant's frame) or as JSON to parse."""
    cap = pools.cap_bytes
    size = c.choice((64 << 10, 1 << 20, cap - 4096, cap - 64, cap + 1, 2 * cap))
    if c.integer(0, 2):
        message = {"r": r, "op": "register_function", "a": ["big", graph(c, pools), [b"\0" * size], 0.0]}
        return Input("register_function", encode(message), r, f"a {size:,}-byte constant")
    payload = ("0," * (size // 2))[:-1]
    frames = [f'{{"$d":[["r",{r}],["op","release_many"],["a",[[{payload}]]]]}}'.encode()]
    return Input("release_many", frames, r, f"{len(frames[0]):,} bytes of JSON ints")


# Requests that may hold the service's worker for this client, or the service: sent once each, at points spread over
# the run (the random part draws only short waits). Each is (name, op, args-maker taking the pools).
HAZARDS = (
    ("16 MiB constant", None, None),
    ("12 MB of [[],[],...]", None, None),
    ("wait_for_executors(more, 1e308)", "wait_for_executors", lambda p: [len(p.executor_ids) + 5, 1e308]),
    ("wait_for_executors(more, inf)", "wait_for_executors", lambda p: [len(p.executor_ids) + 5, math.inf]),
    ("wait_for_executors(more, nan)", "wait_for_executors", lambda p: [len(p.executor_ids) + 5, math.nan]),
    ("replace_executor(live, inf)", "replace_executor", lambda p: [p.executor_ids[0], math.inf]),
    ("register_function(sim 1e308)", "register_function",
     lambda p: ["slow", p.graphs[0] if p.graphs else pb.Graph(), [], 1e308]),
    ("register_function(sim inf)", "register_function",
     lambda p: ["slow", p.graphs[0] if p.graphs else pb.Graph(), [], math.inf]),
)


def hazard(name: str, op, make, pools: Pools, r: int) -> Input:
    if name == "16 MiB constant":
        return Input("register_function", encode({"r": r, "op": "register_function",
                                                  "a": ["big", pb.Graph(), [b"\0" * (16 << 20)], 0.0]}), r, name)
    if name.startswith("12 MB"):
        payload = ",".join(["[]"] * (4 << 20))
        return Input("release_many", [f'{{"$d":[["r",{r}],["op","release_many"],["a",[[{payload}]]]]}}'.encode()], r,
                     name)
    return Input(op, encode({"r": r, "op": op, "a": make(pools)}), r, name)
