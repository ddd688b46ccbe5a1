"""The allow-list of ops a graph may name: every entry is a real op, and none admits a file, storage or the process;
a service client's graph is refused ops that break the device or the executor for every tenant (issue 46 point 9)."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from pathways_torch.wire import collective_ops  # noqa: F401  (registers torch.ops.pathways.*)
from pathways_torch.wire.graph_schema import encode_graph
from pathways_torch.wire.op_allowlist import (ALLOWED_FAMILIES, ALLOWED_OVERLOADS, ALLOWED_PREFIXES, NEVER_ALLOWED,
                                              SERVICE_REFUSED, TRUSTED_INDICES, ServiceGraphError,
                                              check_service_graph, is_allowed)

pytestmark = pytest.mark.timeout(60)


def _packet(family: str):
    namespace, op = family.split(".", 1)
    return getattr(getattr(torch.ops, namespace), op)


def test_every_entry_names_an_op_of_this_torch():
    """A misspelt family would admit nothing (and hide that a needed op is missing)."""
    unknown = []
    for family in sorted(ALLOWED_FAMILIES | {name.rpartition(".")[0] for name in ALLOWED_OVERLOADS}):
        try:
            _packet(family)
        except (AttributeError, RuntimeError):
            unknown.append(family)
    assert not unknown, f"expected every allow-list entry to be an op of torch {torch.__version__}, got {unknown}"


def test_no_entry_admits_what_must_never_run():
    assert not ALLOWED_FAMILIES & NEVER_ALLOWED
    assert not [family for family in NEVER_ALLOWED if family.startswith(ALLOWED_PREFIXES)]
    for name in ("aten.from_file.default", "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset",
                 "aten.set_.source_Tensor", "aten.resize_.default", "aten._local_scalar_dense.default"):
        assert not is_allowed(name), name


def test_families_admit_every_overload_and_nothing_else():
    assert is_allowed("aten.add.Tensor") and is_allowed("aten.add.Scalar") and is_allowed("aten.add_.Tensor")
    assert is_allowed("aten._foreach_mul_.Scalar") and is_allowed("pathways.all_reduce.default")
    assert not is_allowed("aten.addx.Tensor") and not is_allowed("pathways.pipe_split.default")
    assert not is_allowed("aten") and not is_allowed("")


# ---------------------------------------------------------------- a service's clients (issue 46 point 9)

def _graph(fn, *inputs):
    """``fn`` captured as a client captures it, as the message the controller receives."""
    return encode_graph(make_fx(fn, tracing_mode="fake")(*inputs))[0]   # fake: nothing runs, nothing crashes


def _refusal(fn, *inputs) -> str:
    with pytest.raises(ServiceGraphError) as info:
        check_service_graph(_graph(fn, *inputs))
    return str(info.value)


def test_the_service_refusals_are_allowed_ops_each_with_a_reason():
    """A refusal of an op off the allow-list would be moot; one without a reason could not be judged."""
    assert set(SERVICE_REFUSED) == {"aten._assert_async", "aten._functional_assert_async", "aten._cummax_helper",
                                    "aten._cummin_helper", "aten._embedding_bag_backward", "aten._ctc_loss_backward"}
    for family, reason in {**SERVICE_REFUSED, **{f: "" for f in TRUSTED_INDICES}}.items():
        assert family in ALLOWED_FAMILIES, family
        _packet(family)
        assert family not in SERVICE_REFUSED or len(reason) > 40
    for backward, (forward, position) in TRUSTED_INDICES.items():
        schema = _packet(backward).default._schema
        assert [a.name for a in schema.arguments][1] == "self" and schema.arguments[position].name == "indices"
        assert _packet(forward).default._schema.arguments[0].name == "self"


def test_an_assert_is_refused_to_a_service_client_naming_why():
    def checked(x):
        torch.ops.aten._assert_async.msg(x.sum() > 0, "positive")
        return x * 2

    text = _refusal(checked, torch.ones(3))
    assert "aten._assert_async.msg" in text and "refused to a service client" in text
    assert "CUDA" in text and "every tenant" in text and "embedded pw.Context" in text
    assert is_allowed("aten._assert_async.msg")   # an embedded context's single user may still assert


def test_a_training_step_with_max_pool_and_embedding_passes():
    def step(x, tokens):
        x = x.detach().requires_grad_()
        loss = F.max_pool2d(x, 2).sum() + F.adaptive_max_pool2d(x, 2).sum() + F.embedding(tokens, x[0, 0]).sum()
        return torch.autograd.grad(loss, x)[0]

    graph = _graph(step, torch.randn(1, 1, 4, 4), torch.tensor([0, 1]))
    targets = {node.target for node in graph.nodes}
    assert {"aten.max_pool2d_with_indices_backward.default", "aten.adaptive_max_pool2d_backward.default",
            "aten.embedding_dense_backward.default"} <= targets
    check_service_graph(graph)


def test_max_pool_backward_with_made_up_indices_is_refused():
    """Measured on CPU: these indices make the executor process segfault (every tenant's executor)."""
    aten = torch.ops.aten

    def made_up(x, grad):
        indices = torch.full((1, 1, 2, 2), 10**9, dtype=torch.long)
        return aten.max_pool2d_with_indices_backward(grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices)

    def changed_first(x, grad):
        _, indices = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
        indices.view(-1).add_(10**9)   # through a view: the backward still names the forward's output
        return aten.max_pool2d_with_indices_backward(grad, x, [2, 2], [2, 2], [0, 0], [1, 1], False, indices)

    def other_input(x, grad):
        _, indices = aten.adaptive_max_pool2d(torch.randn(1, 1, 64, 64), [2, 2])
        return aten.adaptive_max_pool2d_backward(grad, x, indices)

    x, grad = torch.randn(1, 1, 4, 4), torch.ones(1, 1, 2, 2)
    assert "expected its indices to be output 1 of aten.max_pool2d_with_indices.default" in _refusal(made_up, x, grad)
    assert "used by max-pool backward ops alone" in _refusal(changed_first, x, grad)
    assert "expected its self to be the input of" in _refusal(other_input, x, grad)
    assert "segmentation fault" in _refusal(made_up, x, grad)


def test_scaled_embedding_backward_and_internal_helpers_are_refused():
    aten = torch.ops.aten

    def scaled(grad, tokens):
        return aten.embedding_dense_backward(grad, tokens, 5, -1, True)

    def helper(x, values, indices):
        aten._cummax_helper(x, values, indices, 0)
        return values

    assert "expected scale_grad_by_freq=False" in _refusal(scaled, torch.ones(2, 4), torch.tensor([0, 1]))
    check_service_graph(_graph(lambda g, t: aten.embedding_dense_backward(g, t, 5, -1, False), torch.ones(2, 4),
                               torch.tensor([0, 1])))
    text = _refusal(helper, torch.randn(4), torch.randn(4), torch.zeros(4, dtype=torch.long))
    assert "aten._cummax_helper.default" in text and "heap corruption" in text
