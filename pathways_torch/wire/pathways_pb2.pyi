from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "frame")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    frame: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., frame: _Optional[int] = ...) -> None: ...

class ShardRef(_message.Message):
    __slots__ = ("array_id", "shard", "tag")
    ARRAY_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    array_id: int
    shard: int
    tag: int
    def __init__(self, array_id: _Optional[int] = ..., shard: _Optional[int] = ..., tag: _Optional[int] = ...) -> None: ...

class Arg(_message.Message):
    __slots__ = ("node", "int_value", "float_value", "bool_value", "none", "str_value", "dtype", "memory_format", "device", "layout", "list", "constant")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    STR_VALUE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    CONSTANT_FIELD_NUMBER: _ClassVar[int]
    node: int
    int_value: int
    float_value: float
    bool_value: bool
    none: bool
    str_value: str
    dtype: str
    memory_format: str
    device: str
    layout: str
    list: ArgList
    constant: int
    def __init__(self, node: _Optional[int] = ..., int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., bool_value: _Optional[bool] = ..., none: _Optional[bool] = ..., str_value: _Optional[str] = ..., dtype: _Optional[str] = ..., memory_format: _Optional[str] = ..., device: _Optional[str] = ..., layout: _Optional[str] = ..., list: _Optional[_Union[ArgList, _Mapping]] = ..., constant: _Optional[int] = ...) -> None: ...

class ArgList(_message.Message):
    __slots__ = ("items", "is_tuple")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    IS_TUPLE_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Arg]
    is_tuple: bool
    def __init__(self, items: _Optional[_Iterable[_Union[Arg, _Mapping]]] = ..., is_tuple: _Optional[bool] = ...) -> None: ...

class NamedArg(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: Arg
    def __init__(self, name: _Optional[str] = ..., value: _Optional[_Union[Arg, _Mapping]] = ...) -> None: ...

class GraphNode(_message.Message):
    __slots__ = ("op", "target", "args", "kwargs", "name")
    OP_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    op: str
    target: str
    args: _containers.RepeatedCompositeFieldContainer[Arg]
    kwargs: _containers.RepeatedCompositeFieldContainer[NamedArg]
    name: str
    def __init__(self, op: _Optional[str] = ..., target: _Optional[str] = ..., args: _Optional[_Iterable[_Union[Arg, _Mapping]]] = ..., kwargs: _Optional[_Iterable[_Union[NamedArg, _Mapping]]] = ..., name: _Optional[str] = ...) -> None: ...

class Graph(_message.Message):
    __slots__ = ("nodes", "constants", "inputs", "outputs", "donated_inputs")
    NODES_FIELD_NUMBER: _ClassVar[int]
    CONSTANTS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DONATED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[GraphNode]
    constants: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    inputs: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    donated_inputs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, nodes: _Optional[_Iterable[_Union[GraphNode, _Mapping]]] = ..., constants: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., inputs: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., donated_inputs: _Optional[_Iterable[int]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("executor_id", "data_address", "device", "backend", "pid", "store_bytes", "public_key", "command_address", "island", "transfer_address")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    data_address: str
    device: str
    backend: str
    pid: int
    store_bytes: int
    public_key: bytes
    command_address: str
    island: str
    transfer_address: str
    def __init__(self, executor_id: _Optional[str] = ..., data_address: _Optional[str] = ..., device: _Optional[str] = ..., backend: _Optional[str] = ..., pid: _Optional[int] = ..., store_bytes: _Optional[int] = ..., public_key: _Optional[bytes] = ..., command_address: _Optional[str] = ..., island: _Optional[str] = ..., transfer_address: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("index", "heartbeat_interval_s", "heartbeat_timeout_s", "epoch", "transfer_timeout_s", "put_secret")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PUT_SECRET_FIELD_NUMBER: _ClassVar[int]
    index: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    epoch: int
    transfer_timeout_s: float
    put_secret: bytes
    def __init__(self, index: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., epoch: _Optional[int] = ..., transfer_timeout_s: _Optional[float] = ..., put_secret: _Optional[bytes] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_at", "epoch", "lost_peers", "lost_peers_told", "interval_s")
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOST_PEERS_FIELD_NUMBER: _ClassVar[int]
    LOST_PEERS_TOLD_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    sent_at: float
    epoch: int
    lost_peers: _containers.RepeatedScalarFieldContainer[str]
    lost_peers_told: int
    interval_s: float
    def __init__(self, sent_at: _Optional[float] = ..., epoch: _Optional[int] = ..., lost_peers: _Optional[_Iterable[str]] = ..., lost_peers_told: _Optional[int] = ..., interval_s: _Optional[float] = ...) -> None: ...

class LoadFunction(_message.Message):
    __slots__ = ("function_id", "name", "graph", "sim_seconds")
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    SIM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    function_id: int
    name: str
    graph: Graph
    sim_seconds: float
    def __init__(self, function_id: _Optional[int] = ..., name: _Optional[str] = ..., graph: _Optional[_Union[Graph, _Mapping]] = ..., sim_seconds: _Optional[float] = ...) -> None: ...

class ValueRef(_message.Message):
    __slots__ = ("value", "shard", "copy")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    value: int
    shard: int
    copy: bool
    def __init__(self, value: _Optional[int] = ..., shard: _Optional[int] = ..., copy: _Optional[bool] = ...) -> None: ...

class ProgramNode(_message.Message):
    __slots__ = ("node", "function_id", "inputs", "outputs", "shard", "collective", "prev_collective_node", "axis_groups", "report", "digest_outputs")
    class AxisGroupsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    PREV_COLLECTIVE_NODE_FIELD_NUMBER: _ClassVar[int]
    AXIS_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    node: int
    function_id: int
    inputs: _containers.RepeatedCompositeFieldContainer[ValueRef]
    outputs: _containers.RepeatedScalarFieldContainer[int]
    shard: int
    collective: bool
    prev_collective_node: int
    axis_groups: _containers.ScalarMap[str, int]
    report: bool
    digest_outputs: bool
    def __init__(self, node: _Optional[int] = ..., function_id: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[ValueRef, _Mapping]]] = ..., outputs: _Optional[_Iterable[int]] = ..., shard: _Optional[int] = ..., collective: _Optional[bool] = ..., prev_collective_node: _Optional[int] = ..., axis_groups: _Optional[_Mapping[str, int]] = ..., report: _Optional[bool] = ..., digest_outputs: _Optional[bool] = ...) -> None: ...

class ProgramSend(_message.Message):
    __slots__ = ("value", "shard", "to_node", "to_address", "to_public_key", "to_inbox")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_FIELD_NUMBER: _ClassVar[int]
    TO_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TO_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    TO_INBOX_FIELD_NUMBER: _ClassVar[int]
    value: int
    shard: int
    to_node: int
    to_address: str
    to_public_key: bytes
    to_inbox: bool
    def __init__(self, value: _Optional[int] = ..., shard: _Optional[int] = ..., to_node: _Optional[int] = ..., to_address: _Optional[str] = ..., to_public_key: _Optional[bytes] = ..., to_inbox: _Optional[bool] = ...) -> None: ...

class ProgramAction(_message.Message):
    __slots__ = ("run", "send")
    RUN_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    run: ProgramNode
    send: ProgramSend
    def __init__(self, run: _Optional[_Union[ProgramNode, _Mapping]] = ..., send: _Optional[_Union[ProgramSend, _Mapping]] = ...) -> None: ...

class RegisterProgram(_message.Message):
    __slots__ = ("program_id", "name", "actions", "input_values", "output_values", "local_intermediates", "num_nodes")
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    INPUT_VALUES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_VALUES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_INTERMEDIATES_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    program_id: int
    name: str
    actions: _containers.RepeatedCompositeFieldContainer[ProgramAction]
    input_values: _containers.RepeatedScalarFieldContainer[int]
    output_values: _containers.RepeatedScalarFieldContainer[int]
    local_intermediates: _containers.RepeatedCompositeFieldContainer[ValueRef]
    num_nodes: int
    def __init__(self, program_id: _Optional[int] = ..., name: _Optional[str] = ..., actions: _Optional[_Iterable[_Union[ProgramAction, _Mapping]]] = ..., input_values: _Optional[_Iterable[int]] = ..., output_values: _Optional[_Iterable[int]] = ..., local_intermediates: _Optional[_Iterable[_Union[ValueRef, _Mapping]]] = ..., num_nodes: _Optional[int] = ...) -> None: ...

class RunProgram(_message.Message):
    __slots__ = ("program_id", "base_seq", "base_call_id", "input_array_ids", "output_array_ids", "first_intermediate_id", "prev_collective_seq", "owner", "output_budget_bytes")
    PROGRAM_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_ARRAY_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_ARRAY_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_INTERMEDIATE_ID_FIELD_NUMBER: _ClassVar[int]
    PREV_COLLECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    program_id: int
    base_seq: int
    base_call_id: int
    input_array_ids: _containers.RepeatedScalarFieldContainer[int]
    output_array_ids: _containers.RepeatedScalarFieldContainer[int]
    first_intermediate_id: int
    prev_collective_seq: int
    owner: str
    output_budget_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, program_id: _Optional[int] = ..., base_seq: _Optional[int] = ..., base_call_id: _Optional[int] = ..., input_array_ids: _Optional[_Iterable[int]] = ..., output_array_ids: _Optional[_Iterable[int]] = ..., first_intermediate_id: _Optional[int] = ..., prev_collective_seq: _Optional[int] = ..., owner: _Optional[str] = ..., output_budget_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("seq", "call_id", "function_id", "inputs", "outputs", "digest_outputs", "collective", "prev_collective_seq", "axis_groups", "quiet", "report_shapes", "owner", "donated_inputs", "output_budget_bytes")
    class AxisGroupsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    PREV_COLLECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    AXIS_GROUPS_FIELD_NUMBER: _ClassVar[int]
    QUIET_FIELD_NUMBER: _ClassVar[int]
    REPORT_SHAPES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    DONATED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    call_id: int
    function_id: int
    inputs: _containers.RepeatedCompositeFieldContainer[ShardRef]
    outputs: _containers.RepeatedCompositeFieldContainer[ShardRef]
    digest_outputs: bool
    collective: bool
    prev_collective_seq: int
    axis_groups: _containers.ScalarMap[str, int]
    quiet: bool
    report_shapes: bool
    owner: str
    donated_inputs: _containers.RepeatedScalarFieldContainer[int]
    output_budget_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., call_id: _Optional[int] = ..., function_id: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[ShardRef, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[ShardRef, _Mapping]]] = ..., digest_outputs: _Optional[bool] = ..., collective: _Optional[bool] = ..., prev_collective_seq: _Optional[int] = ..., axis_groups: _Optional[_Mapping[str, int]] = ..., quiet: _Optional[bool] = ..., report_shapes: _Optional[bool] = ..., owner: _Optional[str] = ..., donated_inputs: _Optional[_Iterable[int]] = ..., output_budget_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class FormGroup(_message.Message):
    __slots__ = ("seq", "prev_collective_seq", "group_id", "rank", "size", "store_path", "timeout_s", "members")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PREV_COLLECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_PATH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    prev_collective_seq: int
    group_id: int
    rank: int
    size: int
    store_path: str
    timeout_s: float
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq: _Optional[int] = ..., prev_collective_seq: _Optional[int] = ..., group_id: _Optional[int] = ..., rank: _Optional[int] = ..., size: _Optional[int] = ..., store_path: _Optional[str] = ..., timeout_s: _Optional[float] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("call_ids", "group_ids", "reason", "lost_executor", "lost_executors", "skip_collectives")
    CALL_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOST_EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    LOST_EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    SKIP_COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    call_ids: _containers.RepeatedScalarFieldContainer[int]
    group_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    lost_executor: str
    lost_executors: _containers.RepeatedScalarFieldContainer[str]
    skip_collectives: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, call_ids: _Optional[_Iterable[int]] = ..., group_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ..., lost_executor: _Optional[str] = ..., lost_executors: _Optional[_Iterable[str]] = ..., skip_collectives: _Optional[_Iterable[int]] = ...) -> None: ...

class TreeChild(_message.Message):
    __slots__ = ("executor_id", "data_address", "public_key", "position", "end")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    data_address: str
    public_key: bytes
    position: int
    end: int
    def __init__(self, executor_id: _Optional[str] = ..., data_address: _Optional[str] = ..., public_key: _Optional[bytes] = ..., position: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class LaunchTree(_message.Message):
    __slots__ = ("generation", "parent", "parent_address", "parent_key", "position", "end", "children")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    generation: int
    parent: str
    parent_address: str
    parent_key: bytes
    position: int
    end: int
    children: _containers.RepeatedCompositeFieldContainer[TreeChild]
    def __init__(self, generation: _Optional[int] = ..., parent: _Optional[str] = ..., parent_address: _Optional[str] = ..., parent_key: _Optional[bytes] = ..., position: _Optional[int] = ..., end: _Optional[int] = ..., children: _Optional[_Iterable[_Union[TreeChild, _Mapping]]] = ...) -> None: ...

class TreeLaunch(_message.Message):
    __slots__ = ("generation", "run", "position", "prev_collective_seqs", "commands_before", "free_array_ids", "sent_at")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PREV_COLLECTIVE_SEQS_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    FREE_ARRAY_IDS_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    run: RunProgram
    position: int
    prev_collective_seqs: _containers.RepeatedScalarFieldContainer[int]
    commands_before: _containers.RepeatedScalarFieldContainer[int]
    free_array_ids: _containers.RepeatedScalarFieldContainer[int]
    sent_at: float
    def __init__(self, generation: _Optional[int] = ..., run: _Optional[_Union[RunProgram, _Mapping]] = ..., position: _Optional[int] = ..., prev_collective_seqs: _Optional[_Iterable[int]] = ..., commands_before: _Optional[_Iterable[int]] = ..., free_array_ids: _Optional[_Iterable[int]] = ..., sent_at: _Optional[float] = ...) -> None: ...

class DoneBatch(_message.Message):
    __slots__ = ("generation", "base_call_id", "dones", "groups")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    BASE_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    DONES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    base_call_id: int
    dones: _containers.RepeatedCompositeFieldContainer[Done]
    groups: _containers.RepeatedCompositeFieldContainer[DoneGroup]
    def __init__(self, generation: _Optional[int] = ..., base_call_id: _Optional[int] = ..., dones: _Optional[_Iterable[_Union[Done, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[DoneGroup, _Mapping]]] = ...) -> None: ...

class DoneGroup(_message.Message):
    __slots__ = ("call_id", "executor_ids", "device_ns")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    executor_ids: _containers.RepeatedScalarFieldContainer[str]
    device_ns: int
    def __init__(self, call_id: _Optional[int] = ..., executor_ids: _Optional[_Iterable[str]] = ..., device_ns: _Optional[int] = ...) -> None: ...

class AdmitKey(_message.Message):
    __slots__ = ("role", "public_key")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    role: str
    public_key: bytes
    def __init__(self, role: _Optional[str] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class SendShard(_message.Message):
    __slots__ = ("shard", "to_address", "as_ref", "call_id", "to_public_key", "to_inbox")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TO_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AS_REF_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TO_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    TO_INBOX_FIELD_NUMBER: _ClassVar[int]
    shard: ShardRef
    to_address: str
    as_ref: ShardRef
    call_id: int
    to_public_key: bytes
    to_inbox: bool
    def __init__(self, shard: _Optional[_Union[ShardRef, _Mapping]] = ..., to_address: _Optional[str] = ..., as_ref: _Optional[_Union[ShardRef, _Mapping]] = ..., call_id: _Optional[int] = ..., to_public_key: _Optional[bytes] = ..., to_inbox: _Optional[bool] = ...) -> None: ...

class Free(_message.Message):
    __slots__ = ("shards", "spent_puts")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SPENT_PUTS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardRef]
    spent_puts: _containers.RepeatedCompositeFieldContainer[SpentPut]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardRef, _Mapping]]] = ..., spent_puts: _Optional[_Iterable[_Union[SpentPut, _Mapping]]] = ...) -> None: ...

class SpentPut(_message.Message):
    __slots__ = ("role", "sequence")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    role: str
    sequence: int
    def __init__(self, role: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class Forget(_message.Message):
    __slots__ = ("function_ids", "program_ids")
    FUNCTION_IDS_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_IDS_FIELD_NUMBER: _ClassVar[int]
    function_ids: _containers.RepeatedScalarFieldContainer[int]
    program_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, function_ids: _Optional[_Iterable[int]] = ..., program_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoteFailure(_message.Message):
    __slots__ = ("type", "message", "traceback", "executor_id", "origin_call_id", "op", "node_index")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    traceback: str
    executor_id: str
    origin_call_id: int
    op: str
    node_index: int
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., executor_id: _Optional[str] = ..., origin_call_id: _Optional[int] = ..., op: _Optional[str] = ..., node_index: _Optional[int] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("call_id", "seq", "ok", "failure", "digests", "output_shapes", "device_ns", "executor_id")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHAPES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    seq: int
    ok: bool
    failure: RemoteFailure
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    output_shapes: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    device_ns: int
    executor_id: str
    def __init__(self, call_id: _Optional[int] = ..., seq: _Optional[int] = ..., ok: _Optional[bool] = ..., failure: _Optional[_Union[RemoteFailure, _Mapping]] = ..., digests: _Optional[_Iterable[bytes]] = ..., output_shapes: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., device_ns: _Optional[int] = ..., executor_id: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    def __init__(self, request_id: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("request_id", "executor_id", "store_bytes", "store_buffers", "hop_bytes", "num_computations", "num_function_loads", "num_compiles", "backend", "backend_counters", "queue_high_water", "store_bytes_high_water", "transfers_lost", "programs_held", "functions_held", "fusion")
    class HopBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BackendCountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    HOP_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FUNCTION_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPILES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_HIGH_WATER_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_HIGH_WATER_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_LOST_FIELD_NUMBER: _ClassVar[int]
    PROGRAMS_HELD_FIELD_NUMBER: _ClassVar[int]
    FUNCTIONS_HELD_FIELD_NUMBER: _ClassVar[int]
    FUSION_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    executor_id: str
    store_bytes: int
    store_buffers: int
    hop_bytes: _containers.ScalarMap[str, int]
    num_computations: int
    num_function_loads: int
    num_compiles: int
    backend: str
    backend_counters: _containers.ScalarMap[str, int]
    queue_high_water: int
    store_bytes_high_water: int
    transfers_lost: int
    programs_held: int
    functions_held: int
    fusion: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[int] = ..., executor_id: _Optional[str] = ..., store_bytes: _Optional[int] = ..., store_buffers: _Optional[int] = ..., hop_bytes: _Optional[_Mapping[str, int]] = ..., num_computations: _Optional[int] = ..., num_function_loads: _Optional[int] = ..., num_compiles: _Optional[int] = ..., backend: _Optional[str] = ..., backend_counters: _Optional[_Mapping[str, int]] = ..., queue_high_water: _Optional[int] = ..., store_bytes_high_water: _Optional[int] = ..., transfers_lost: _Optional[int] = ..., programs_held: _Optional[int] = ..., functions_held: _Optional[int] = ..., fusion: _Optional[_Iterable[str]] = ...) -> None: ...

class TraceEvent(_message.Message):
    __slots__ = ("name", "kind", "time_ns", "seq", "call_id", "function_id", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIME_NS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    time_ns: int
    seq: int
    call_id: int
    function_id: int
    detail: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., time_ns: _Optional[int] = ..., seq: _Optional[int] = ..., call_id: _Optional[int] = ..., function_id: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    def __init__(self, request_id: _Optional[int] = ...) -> None: ...

class TraceReply(_message.Message):
    __slots__ = ("request_id", "executor_id", "events")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    executor_id: str
    events: _containers.RepeatedCompositeFieldContainer[TraceEvent]
    def __init__(self, request_id: _Optional[int] = ..., executor_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[TraceEvent, _Mapping]]] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Put(_message.Message):
    __slots__ = ("shard", "tensor", "request_id", "more", "token")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    shard: ShardRef
    tensor: TensorMeta
    request_id: int
    more: _containers.RepeatedCompositeFieldContainer[PutItem]
    token: bytes
    def __init__(self, shard: _Optional[_Union[ShardRef, _Mapping]] = ..., tensor: _Optional[_Union[TensorMeta, _Mapping]] = ..., request_id: _Optional[int] = ..., more: _Optional[_Iterable[_Union[PutItem, _Mapping]]] = ..., token: _Optional[bytes] = ...) -> None: ...

class PutItem(_message.Message):
    __slots__ = ("shard", "tensor", "token")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    shard: ShardRef
    tensor: TensorMeta
    token: bytes
    def __init__(self, shard: _Optional[_Union[ShardRef, _Mapping]] = ..., tensor: _Optional[_Union[TensorMeta, _Mapping]] = ..., token: _Optional[bytes] = ...) -> None: ...

class PutAck(_message.Message):
    __slots__ = ("request_id", "shard", "failed", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    shard: ShardRef
    failed: bool
    failure: RemoteFailure
    def __init__(self, request_id: _Optional[int] = ..., shard: _Optional[_Union[ShardRef, _Mapping]] = ..., failed: _Optional[bool] = ..., failure: _Optional[_Union[RemoteFailure, _Mapping]] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("shard", "tensor", "failure", "failed", "ring_invite")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RING_INVITE_FIELD_NUMBER: _ClassVar[int]
    shard: ShardRef
    tensor: TensorMeta
    failure: RemoteFailure
    failed: bool
    ring_invite: RingInvite
    def __init__(self, shard: _Optional[_Union[ShardRef, _Mapping]] = ..., tensor: _Optional[_Union[TensorMeta, _Mapping]] = ..., failure: _Optional[_Union[RemoteFailure, _Mapping]] = ..., failed: _Optional[bool] = ..., ring_invite: _Optional[_Union[RingInvite, _Mapping]] = ...) -> None: ...

class RingInvite(_message.Message):
    __slots__ = ("socket", "token", "writer_epoch")
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WRITER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    socket: bytes
    token: bytes
    writer_epoch: int
    def __init__(self, socket: _Optional[bytes] = ..., token: _Optional[bytes] = ..., writer_epoch: _Optional[int] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("shard",)
    SHARD_FIELD_NUMBER: _ClassVar[int]
    shard: ShardRef
    def __init__(self, shard: _Optional[_Union[ShardRef, _Mapping]] = ...) -> None: ...

class TransferLost(_message.Message):
    __slots__ = ("shard", "to_address", "waited_s", "nbytes", "missing", "failure")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TO_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    shard: ShardRef
    to_address: str
    waited_s: float
    nbytes: int
    missing: bool
    failure: RemoteFailure
    def __init__(self, shard: _Optional[_Union[ShardRef, _Mapping]] = ..., to_address: _Optional[str] = ..., waited_s: _Optional[float] = ..., nbytes: _Optional[int] = ..., missing: _Optional[bool] = ..., failure: _Optional[_Union[RemoteFailure, _Mapping]] = ...) -> None: ...

class Fetch(_message.Message):
    __slots__ = ("shard", "request_id")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    shard: ShardRef
    request_id: int
    def __init__(self, shard: _Optional[_Union[ShardRef, _Mapping]] = ..., request_id: _Optional[int] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("request_id", "tensor", "failure", "failed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    tensor: TensorMeta
    failure: RemoteFailure
    failed: bool
    def __init__(self, request_id: _Optional[int] = ..., tensor: _Optional[_Union[TensorMeta, _Mapping]] = ..., failure: _Optional[_Union[RemoteFailure, _Mapping]] = ..., failed: _Optional[bool] = ...) -> None: ...

class SaveShards(_message.Message):
    __slots__ = ("request_id", "shards", "names", "path")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardRef]
    names: _containers.RepeatedScalarFieldContainer[str]
    path: str
    def __init__(self, request_id: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardRef, _Mapping]]] = ..., names: _Optional[_Iterable[str]] = ..., path: _Optional[str] = ...) -> None: ...

class SaveReply(_message.Message):
    __slots__ = ("request_id", "failed", "failure", "bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    failed: bool
    failure: RemoteFailure
    bytes: int
    def __init__(self, request_id: _Optional[int] = ..., failed: _Optional[bool] = ..., failure: _Optional[_Union[RemoteFailure, _Mapping]] = ..., bytes: _Optional[int] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("request_id", "op", "key", "value", "amount", "keys")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    op: str
    key: str
    value: bytes
    amount: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[int] = ..., op: _Optional[str] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., amount: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("request_id", "ok", "value", "number", "found", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    ok: bool
    value: bytes
    number: int
    found: bool
    error: str
    def __init__(self, request_id: _Optional[int] = ..., ok: _Optional[bool] = ..., value: _Optional[bytes] = ..., number: _Optional[int] = ..., found: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("register", "welcome", "heartbeat", "load_function", "run", "send_shard", "free", "done", "stats_request", "stats", "trace_request", "trace_reply", "shutdown", "form_group", "register_program", "run_program", "put", "put_ack", "transfer", "fetch", "fetch_reply", "store_request", "store_reply", "save_shards", "save_reply", "cancel", "admit_key", "transfer_ack", "transfer_lost", "forget", "launch_tree", "tree_launch", "done_batch", "frees", "epoch", "command_index", "launches_before")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    SEND_SHARD_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATS_REQUEST_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    TRACE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACE_REPLY_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    FORM_GROUP_FIELD_NUMBER: _ClassVar[int]
    REGISTER_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    RUN_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    PUT_FIELD_NUMBER: _ClassVar[int]
    PUT_ACK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    FETCH_REPLY_FIELD_NUMBER: _ClassVar[int]
    STORE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    STORE_REPLY_FIELD_NUMBER: _ClassVar[int]
    SAVE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SAVE_REPLY_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ADMIT_KEY_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ACK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_LOST_FIELD_NUMBER: _ClassVar[int]
    FORGET_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_TREE_FIELD_NUMBER: _ClassVar[int]
    TREE_LAUNCH_FIELD_NUMBER: _ClassVar[int]
    DONE_BATCH_FIELD_NUMBER: _ClassVar[int]
    FREES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMAND_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAUNCHES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    register: Register
    welcome: Welcome
    heartbeat: Heartbeat
    load_function: LoadFunction
    run: Run
    send_shard: SendShard
    free: Free
    done: Done
    stats_request: StatsRequest
    stats: Stats
    trace_request: TraceRequest
    trace_reply: TraceReply
    shutdown: Shutdown
    form_group: FormGroup
    register_program: RegisterProgram
    run_program: RunProgram
    put: Put
    put_ack: PutAck
    transfer: Transfer
    fetch: Fetch
    fetch_reply: FetchReply
    store_request: StoreRequest
    store_reply: StoreReply
    save_shards: SaveShards
    save_reply: SaveReply
    cancel: Cancel
    admit_key: AdmitKey
    transfer_ack: TransferAck
    transfer_lost: TransferLost
    forget: Forget
    launch_tree: LaunchTree
    tree_launch: TreeLaunch
    done_batch: DoneBatch
    frees: _containers.RepeatedCompositeFieldContainer[ShardRef]
    epoch: int
    command_index: int
    launches_before: int
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., load_function: _Optional[_Union[LoadFunction, _Mapping]] = ..., run: _Optional[_Union[Run, _Mapping]] = ..., send_shard: _Optional[_Union[SendShard, _Mapping]] = ..., free: _Optional[_Union[Free, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., stats_request: _Optional[_Union[StatsRequest, _Mapping]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., trace_request: _Optional[_Union[TraceRequest, _Mapping]] = ..., trace_reply: _Optional[_Union[TraceReply, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., form_group: _Optional[_Union[FormGroup, _Mapping]] = ..., register_program: _Optional[_Union[RegisterProgram, _Mapping]] = ..., run_program: _Optional[_Union[RunProgram, _Mapping]] = ..., put: _Optional[_Union[Put, _Mapping]] = ..., put_ack: _Optional[_Union[PutAck, _Mapping]] = ..., transfer: _Optional[_Union[Transfer, _Mapping]] = ..., fetch: _Optional[_Union[Fetch, _Mapping]] = ..., fetch_reply: _Optional[_Union[FetchReply, _Mapping]] = ..., store_request: _Optional[_Union[StoreRequest, _Mapping]] = ..., store_reply: _Optional[_Union[StoreReply, _Mapping]] = ..., save_shards: _Optional[_Union[SaveShards, _Mapping]] = ..., save_reply: _Optional[_Union[SaveReply, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., admit_key: _Optional[_Union[AdmitKey, _Mapping]] = ..., transfer_ack: _Optional[_Union[TransferAck, _Mapping]] = ..., transfer_lost: _Optional[_Union[TransferLost, _Mapping]] = ..., forget: _Optional[_Union[Forget, _Mapping]] = ..., launch_tree: _Optional[_Union[LaunchTree, _Mapping]] = ..., tree_launch: _Optional[_Union[TreeLaunch, _Mapping]] = ..., done_batch: _Optional[_Union[DoneBatch, _Mapping]] = ..., frees: _Optional[_Iterable[_Union[ShardRef, _Mapping]]] = ..., epoch: _Optional[int] = ..., command_index: _Optional[int] = ..., launches_before: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("with_stats",)
    WITH_STATS_FIELD_NUMBER: _ClassVar[int]
    with_stats: bool
    def __init__(self, with_stats: _Optional[bool] = ...) -> None: ...

class ExecutorStatus(_message.Message):
    __slots__ = ("executor_id", "island", "device", "backend", "state", "epoch", "seconds_since_heartbeat", "node", "store_bytes", "queue_high_water")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_HIGH_WATER_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    island: str
    device: str
    backend: str
    state: str
    epoch: int
    seconds_since_heartbeat: float
    node: str
    store_bytes: int
    queue_high_water: int
    def __init__(self, executor_id: _Optional[str] = ..., island: _Optional[str] = ..., device: _Optional[str] = ..., backend: _Optional[str] = ..., state: _Optional[str] = ..., epoch: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., node: _Optional[str] = ..., store_bytes: _Optional[int] = ..., queue_high_water: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("run_id", "executors", "calls_in_flight", "arrays", "stats_error", "clients", "refused_clients", "dropped_client_messages", "refused_admin_requests", "refused_client_requests")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    STATS_ERROR_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_CLIENT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_ADMIN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CLIENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorStatus]
    calls_in_flight: int
    arrays: int
    stats_error: str
    clients: _containers.RepeatedCompositeFieldContainer[ClientStatus]
    refused_clients: int
    dropped_client_messages: int
    refused_admin_requests: int
    refused_client_requests: int
    def __init__(self, run_id: _Optional[str] = ..., executors: _Optional[_Iterable[_Union[ExecutorStatus, _Mapping]]] = ..., calls_in_flight: _Optional[int] = ..., arrays: _Optional[int] = ..., stats_error: _Optional[str] = ..., clients: _Optional[_Iterable[_Union[ClientStatus, _Mapping]]] = ..., refused_clients: _Optional[int] = ..., dropped_client_messages: _Optional[int] = ..., refused_admin_requests: _Optional[int] = ..., refused_client_requests: _Optional[int] = ...) -> None: ...

class ClientStatus(_message.Message):
    __slots__ = ("name", "weight", "share_last_minute", "device_seconds_last_minute", "calls_in_flight", "calls_waiting", "arrays", "requests_served", "seconds_since_heard")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SHARE_LAST_MINUTE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_LAST_MINUTE_FIELD_NUMBER: _ClassVar[int]
    CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CALLS_WAITING_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    share_last_minute: float
    device_seconds_last_minute: float
    calls_in_flight: int
    calls_waiting: int
    arrays: int
    requests_served: int
    seconds_since_heard: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., share_last_minute: _Optional[float] = ..., device_seconds_last_minute: _Optional[float] = ..., calls_in_flight: _Optional[int] = ..., calls_waiting: _Optional[int] = ..., arrays: _Optional[int] = ..., requests_served: _Optional[int] = ..., seconds_since_heard: _Optional[float] = ...) -> None: ...

class AdminRequest(_message.Message):
    __slots__ = ("set_weight", "disconnect", "drain")
    SET_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DISCONNECT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    set_weight: SetWeight
    disconnect: str
    drain: str
    def __init__(self, set_weight: _Optional[_Union[SetWeight, _Mapping]] = ..., disconnect: _Optional[str] = ..., drain: _Optional[str] = ...) -> None: ...

class SetWeight(_message.Message):
    __slots__ = ("client", "weight")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    client: str
    weight: float
    def __init__(self, client: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class AdminReply(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
