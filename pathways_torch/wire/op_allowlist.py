"""The ops a received graph may name: what capture and its decompositions produce, and the collectives.

A graph arrives from the controller and runs on an executor, so the op names it carries are a
way into the executor's process. Whole namespaces are too much: ``aten`` alone holds
``from_file`` (``shared=True`` creates and writes a file on the executor's host) and ``set_``
with a ``Storage`` source. So a name resolves only when it is listed here, by family (an op
*packet*: every overload of ``aten.add``) where every overload is plain tensor math, or one
overload at a time where not.

What is listed (a survey of every graph the test suite, the models and the examples send, then
the families such graphs are made of): ``make_fx`` (`pathways_torch.capture`) traces below
autograd and without a decomposition table, so a graph holds the aten ops the user's code
reaches after torch's implicit decompositions: pointwise math and its in-place forms, reductions,
views and indexing, tensor creation and random numbers, linear algebra and FFTs, convolution,
pooling, normalization, losses, attention and their backward ops, the ``_foreach_`` and
``_fused_`` optimizer kernels; and the ``pathways::`` collectives (`pathways_torch.collectives`).
Pipelines and training steps trace with the same ``make_fx``; the backends' own decompositions
run on the executor after the graph is decoded, so they need no entry here.

Never listed (`NEVER_ALLOWED`): ops that read or write files, reach storage or memory by
address, or act on the process. A test checks that no entry admits one.

An op a model needs that is missing here is refused when its function is captured, naming it:
add its family to the right group below, with a test that captures a function using it.

Stricter for a service's clients (`check_service_graph`, called by the controller of ``pathways-controller`` on
every graph a remote client registers): its executors are shared by strangers, so an op that can break the device
or the executor process for everyone is refused, each with its reason in `SERVICE_REFUSED` (docs/security.md):

- ``_assert_async`` and ``_functional_assert_async``: a device-side assert. On CUDA a failing one leaves the
  device's context unusable: every later kernel of every tenant on that executor fails until it restarts.
- ``_cummax_helper``, ``_cummin_helper``: internal helpers (capture emits ``cummax``/``cummin``) that write into
  caller-given outputs unchecked; measured on CPU with mismatched shapes: heap corruption, the executor aborts.
- ``_embedding_bag_backward`` and ``_ctc_loss_backward``: they trust offsets and lengths to come from their
  forward op; measured on CPU with made-up ones: a segmentation fault.
- The max-pool backward ops (`TRUSTED_INDICES`) index with their forward op's saved indices unchecked (measured on
  CPU with made-up ones: a segmentation fault). They are allowed with indices straight from the matching forward op
  over the same input, used by nothing else (so no in-place op changes them first): as a traced training step
  has them. Out-of-range indices cannot come from there.
- ``embedding_dense_backward`` with ``scale_grad_by_freq=True`` counts per index unchecked (measured on CPU: a
  segmentation fault); without it, out-of-range indices are skipped.

An embedded context keeps all of them: its single user can only break its own run. Not refused, and why: the
kernels that check data-dependent bounds with a *device-side* assert on CUDA (out-of-range indices in
``index``/``gather``/``scatter``/``embedding``, targets in ``nll_loss``): every model needs them; on CPU and XLA
they raise an ordinary error or clamp. Their inputs are the tenant's data, so no graph check can rule them out: on
CUDA, strangers who must not be able to stop each other get executors of their own. The list above comes from a
survey, not a proof: about fifty listed ops that take indices, offsets, lengths or saved tensors were called on CPU
with made-up ones (torch 2.14); those that crashed are above, the others raised an error, skipped or clamped, or ran
without a sign either way (``_pdist_backward``, ``_cdist_backward``, ``unfold_backward`` with mismatched shapes).
aten's kernels are written for callers that are not hostile.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["ALLOWED_FAMILIES", "ALLOWED_OVERLOADS", "ALLOWED_PREFIXES", "NEVER_ALLOWED", "SERVICE_REFUSED",
           "TRUSTED_INDICES", "ServiceGraphError", "check_service_graph", "is_allowed"]

_POINTWISE = """
    abs abs_ acos acos_ acosh acosh_ add add_ addcdiv addcdiv_ addcmul addcmul_ angle asin asin_ asinh asinh_
    atan atan2 atan2_ atan_ atanh atanh_ bitwise_and bitwise_and_ bitwise_left_shift bitwise_left_shift_
    bitwise_not bitwise_not_ bitwise_or bitwise_or_ bitwise_right_shift bitwise_right_shift_ bitwise_xor
    bitwise_xor_ ceil ceil_ celu celu_ clamp clamp_ clamp_max clamp_max_ clamp_min clamp_min_ clip clip_
    conj_physical conj_physical_ _conj_physical copysign copysign_ cos cos_ cosh cosh_ deg2rad deg2rad_ digamma
    digamma_ div div_ elu elu_ eq eq_ equal erf erf_ erfc erfc_ erfinv erfinv_ exp exp2 exp2_ exp_ expm1 expm1_
    float_power float_power_ floor floor_ floor_divide floor_divide_ fmax fmin fmod fmod_ frac frac_ frexp gcd
    ge ge_ gelu gelu_ gt gt_ hardshrink hardsigmoid hardsigmoid_ hardswish hardswish_ hardtanh hardtanh_
    heaviside hypot hypot_ i0 i0_ igamma igamma_ igammac igammac_ isfinite isin isinf isnan isneginf isposinf
    lcm ldexp ldexp_ le le_ leaky_relu leaky_relu_ lerp lerp_ lgamma lgamma_ log log10 log10_ log1p log1p_
    log2 log2_ log_ logaddexp logaddexp2 logical_and logical_and_ logical_not logical_not_ logical_or
    logical_or_ logical_xor logical_xor_ logit logit_ lt lt_ masked_fill masked_fill_ maximum minimum mish
    mish_ mul mul_ mvlgamma mvlgamma_ nan_to_num nan_to_num_ ne ne_ neg neg_ nextafter nextafter_ polygamma
    polygamma_ positive pow pow_ rad2deg rad2deg_ reciprocal reciprocal_ relu relu6 relu_ remainder remainder_
    round round_ rrelu rsqrt rsqrt_ rsub selu selu_ sgn sgn_ sigmoid sigmoid_ sign sign_ signbit silu silu_
    sin sin_ sinc sinc_ sinh sinh_ softplus softshrink sqrt sqrt_ square square_ sub sub_ tan tan_ tanh tanh_
    threshold threshold_ true_divide true_divide_ trunc trunc_ where xlogy xlogy_
    __and__ __iand__ __ilshift__ __ior__ __irshift__ __ixor__ __lshift__ __or__ __rshift__ __xor__
    special_airy_ai special_bessel_j0 special_bessel_j1 special_bessel_y0 special_bessel_y1 special_entr
    special_erfcx special_i0e special_i1 special_i1e special_log_ndtr special_modified_bessel_i0
    special_modified_bessel_i1 special_modified_bessel_k0 special_modified_bessel_k1 special_ndtri
    special_scaled_modified_bessel_k0 special_scaled_modified_bessel_k1 special_spherical_bessel_j0
    special_xlog1py special_zeta _conj conj resolve_conj resolve_neg _neg_view complex polar view_as_real
    view_as_complex real imag
"""

# The backward ops of the activations above (what autograd records for them).
_ACTIVATION_BACKWARD = """
    elu_backward gelu_backward glu glu_backward hardshrink_backward hardsigmoid_backward hardswish_backward
    hardtanh_backward leaky_relu_backward log_sigmoid_backward log_sigmoid_forward logit_backward mish_backward
    _prelu_kernel _prelu_kernel_backward rrelu_with_noise rrelu_with_noise_backward sigmoid_backward
    silu_backward softplus_backward softshrink_backward tanh_backward threshold_backward
"""

_REDUCTIONS = """
    all amax amin aminmax any argmax argmin argsort bincount bucketize count_nonzero cummax cummin _cummax_helper
    _cummin_helper cumprod cumprod_ cumsum cumsum_ histc kthvalue logcumsumexp _logcumsumexp logsumexp max mean
    median min mode nanmedian nansum norm prod searchsorted sort std std_mean sum topk _unique2 unique_consecutive
    unique_dim var var_mean _softmax _log_softmax _softmax_backward_data _log_softmax_backward_data _safe_softmax
"""

_LINEAR_ALGEBRA = """
    addbmm addbmm_ addmm addmm_ _addmm_activation addmv addmv_ addr addr_ baddbmm baddbmm_ bmm dot mm mv vdot
    _int_mm _scaled_mm tril tril_ triu triu_ trace diag_embed diagonal diagonal_backward diagonal_scatter
    linalg_vector_norm linalg_cholesky_ex linalg_cross linalg_eig linalg_householder_product linalg_inv_ex
    linalg_ldl_factor_ex linalg_ldl_solve linalg_lu linalg_lu_factor_ex linalg_lu_solve linalg_matrix_exp
    linalg_qr linalg_solve_triangular _linalg_det _linalg_eigh _linalg_eigvals _linalg_slogdet _linalg_solve_ex
    _linalg_svd cholesky_inverse cholesky_solve _cholesky_solve_helper triangular_solve geqrf ormqr lu_unpack
    _cdist_forward _cdist_backward _pdist_forward _pdist_backward _euclidean_dist
    _fft_c2c _fft_c2r _fft_r2c
"""

_SHAPES_AND_INDEXING = """
    alias as_strided as_strided_scatter cat chunk col2im constant_pad_nd copy copy_ detach detach_ expand
    expand_as flip gather im2col index index_add index_add_ index_copy index_copy_ index_fill index_fill_
    index_put index_put_ index_reduce index_reduce_ index_select lift lift_fresh lift_fresh_copy
    masked_scatter masked_scatter_ masked_select narrow narrow_copy nonzero nonzero_static permute
    pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle put put_ reflection_pad1d
    reflection_pad1d_backward reflection_pad2d reflection_pad2d_backward reflection_pad3d
    reflection_pad3d_backward repeat repeat_interleave replication_pad1d replication_pad1d_backward
    replication_pad2d replication_pad2d_backward replication_pad3d replication_pad3d_backward roll rot90
    scatter scatter_ scatter_add scatter_add_ scatter_reduce scatter_reduce_ select select_backward
    select_scatter slice slice_backward slice_scatter split split_with_sizes squeeze squeeze_ stack t t_ take
    transpose transpose_ unbind unfold unfold_backward unsafe_chunk
    unsafe_split unsafe_split_with_sizes unsqueeze unsqueeze_ _unsafe_view view clone _to_copy
    _reshape_alias _reshape_copy alias_copy as_strided_copy detach_copy diagonal_copy expand_copy permute_copy
    select_copy slice_copy split_copy split_with_sizes_copy squeeze_copy t_copy transpose_copy unbind_copy
    unsqueeze_copy view_copy
"""

_CREATION_AND_RANDOM = """
    arange empty empty_like empty_permuted empty_strided eye fill fill_ full full_like linspace logspace
    new_empty new_empty_strided new_full new_ones new_zeros ones ones_like scalar_tensor zero_ zeros zeros_like
    _efficientzerotensor
    bernoulli bernoulli_ cauchy_ exponential_ geometric_ log_normal_ multinomial native_dropout
    native_dropout_backward normal normal_ poisson rand rand_like randint randint_like randn randn_like randperm
    random_ uniform_
"""

_NETWORK_LAYERS = """
    convolution convolution_backward _convolution
    avg_pool2d avg_pool2d_backward avg_pool3d avg_pool3d_backward max_pool2d_with_indices
    max_pool2d_with_indices_backward max_pool3d_with_indices max_pool3d_with_indices_backward
    _adaptive_avg_pool2d _adaptive_avg_pool2d_backward _adaptive_avg_pool3d _adaptive_avg_pool3d_backward
    adaptive_max_pool2d adaptive_max_pool2d_backward adaptive_max_pool3d adaptive_max_pool3d_backward
    upsample_nearest1d upsample_nearest1d_backward upsample_nearest2d upsample_nearest2d_backward
    upsample_nearest3d upsample_nearest3d_backward _upsample_nearest_exact1d _upsample_nearest_exact1d_backward
    _upsample_nearest_exact2d _upsample_nearest_exact2d_backward _upsample_nearest_exact3d
    _upsample_nearest_exact3d_backward upsample_linear1d upsample_linear1d_backward upsample_bilinear2d
    upsample_bilinear2d_backward _upsample_bilinear2d_aa _upsample_bilinear2d_aa_backward upsample_bicubic2d
    upsample_bicubic2d_backward _upsample_bicubic2d_aa _upsample_bicubic2d_aa_backward upsample_trilinear3d
    upsample_trilinear3d_backward grid_sampler_2d grid_sampler_2d_backward grid_sampler_3d
    grid_sampler_3d_backward affine_grid_generator
    native_batch_norm native_batch_norm_backward _native_batch_norm_legit _native_batch_norm_legit_no_training
    _native_batch_norm_legit_functional _batch_norm_with_update _batch_norm_with_update_functional
    _batch_norm_no_update batch_norm_backward batch_norm_stats batch_norm_elemt batch_norm_gather_stats
    batch_norm_gather_stats_with_counts batch_norm_backward_reduce batch_norm_backward_elemt
    native_layer_norm native_layer_norm_backward native_group_norm native_group_norm_backward _fused_rms_norm
    _fused_rms_norm_backward _weight_norm_interface _weight_norm_interface_backward
    embedding embedding_dense_backward embedding_renorm_ _embedding_bag _embedding_bag_forward_only
    _embedding_bag_backward _embedding_bag_dense_backward
    nll_loss_forward nll_loss_backward nll_loss2d_forward nll_loss2d_backward mse_loss mse_loss_backward
    smooth_l1_loss smooth_l1_loss_backward huber_loss huber_loss_backward binary_cross_entropy
    binary_cross_entropy_backward binary_cross_entropy_with_logits soft_margin_loss soft_margin_loss_backward
    multi_margin_loss multi_margin_loss_backward multilabel_margin_loss_forward multilabel_margin_loss_backward
    _ctc_loss _ctc_loss_backward
    _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention_for_cpu_backward
    _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward
    _scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward
    _scaled_dot_product_cudnn_attention _scaled_dot_product_cudnn_attention_backward
    _scaled_dot_product_fused_attention_overrideable _scaled_dot_product_fused_attention_overrideable_backward
"""

# Optimizer kernels (whole families: math over lists of tensors) and mixed precision's loss scaling.
_OPTIMIZERS = """
    _fused_adam _fused_adam_ _fused_adamw _fused_adamw_ _fused_sgd _fused_sgd_ _fused_adagrad _fused_adagrad_
    _amp_foreach_non_finite_check_and_unscale_ _amp_update_scale _amp_update_scale_
    _assert_async _functional_assert_async _assert_tensor_metadata
"""

#: Every overload of these resolves: ``aten.<family>.*``, ``pathways.<family>.*``.
ALLOWED_FAMILIES: frozenset[str] = frozenset(
    [f"aten.{name}" for group in (_POINTWISE, _ACTIVATION_BACKWARD, _REDUCTIONS, _LINEAR_ALGEBRA,
                                  _SHAPES_AND_INDEXING, _CREATION_AND_RANDOM, _NETWORK_LAYERS, _OPTIMIZERS)
     for name in group.split()]
    + ["pathways.all_reduce", "pathways.all_gather", "pathways.reduce_scatter"])

#: Single overloads of families not listed whole (none yet: a family with one unsafe overload is left out).
ALLOWED_OVERLOADS: frozenset[str] = frozenset()

#: Families by prefix: ``aten._foreach_*`` (each the pointwise math above over a list of tensors).
ALLOWED_PREFIXES: tuple[str, ...] = ("aten._foreach_",)

#: Families that no entry may admit, whatever is added: files, storage and memory by address, the process.
NEVER_ALLOWED: frozenset[str] = frozenset({
    "aten.from_file",                # creates and writes a file (shared=True) on the executor's host
    "aten.set_",                     # set_.source_Storage*: a tensor over any storage
    "aten._nested_view_from_buffer", "aten._nested_view_from_buffer_copy", "aten._nested_from_padded",
    "aten._nested_tensor_from_tensor_list",   # nested tensors over raw buffers and offsets
    "aten.resize_", "aten.resize_as_", "aten._resize_output_", "aten.as_strided_",   # re-point a tensor in place
    "aten._pin_memory", "aten.pin_memory", "aten.record_stream", "aten._local_scalar_dense", "aten.item",
    "aten._print", "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset",
    # Index without bounds checks where a backend trusts them (inductor lowers these with check=False; unsafe=True
    # skips the check on CUDA): an index from the graph would read or write outside the buffer. Capture never
    # makes them; a backend's own decompositions may, after the graph is checked.
    "aten._unsafe_index", "aten._unsafe_index_put", "aten._unsafe_masked_index",
    "aten._unsafe_masked_index_put_accumulate", "aten._index_put_impl_",
    # Attention kernels that trust caller-given sequence offsets (cu_seqlens, seqlen_k) as memory bounds.
    "aten._flash_attention_forward", "aten._flash_attention_backward", "aten._efficient_attention_forward",
    "aten._efficient_attention_backward",
})


def is_allowed(name: str) -> bool:
    """Whether ``namespace.op.overload`` is on the allow-list (a listed family, overload or prefix)."""
    family = name.rpartition(".")[0]
    if family in NEVER_ALLOWED:
        return False
    return family in ALLOWED_FAMILIES or name in ALLOWED_OVERLOADS or family.startswith(ALLOWED_PREFIXES)


# ---------------------------------------------------------------- a service's clients: stricter

_DEVICE_ASSERT = ("a device-side assert: on CUDA a failing one leaves the device's context unusable, so every later "
                  "kernel of every tenant on that executor fails")
_HELPER = ("an internal helper that writes into caller-given outputs without checking their shapes (measured on CPU: "
           "heap corruption, the executor process aborts); capture emits cummax/cummin instead")
_TRUSTS_FORWARD = ("it trusts its offsets and lengths to come from its forward op (measured on CPU with made-up ones: "
                   "a segmentation fault of the executor process)")

#: Families a service client's graph may not name, each with why (the module docstring has the survey).
SERVICE_REFUSED = MappingProxyType({
    "aten._assert_async": _DEVICE_ASSERT,
    "aten._functional_assert_async": _DEVICE_ASSERT,
    "aten._cummax_helper": _HELPER,
    "aten._cummin_helper": _HELPER,
    "aten._embedding_bag_backward": _TRUSTS_FORWARD,
    "aten._ctc_loss_backward": _TRUSTS_FORWARD,
})

#: Backward family → (its forward family, the position of its ``indices`` argument). Its ``self`` is argument 1,
#: the forward's input argument 0; the forward's output 1 is the indices.
TRUSTED_INDICES = MappingProxyType({
    "aten.max_pool2d_with_indices_backward": ("aten.max_pool2d_with_indices", 7),
    "aten.max_pool3d_with_indices_backward": ("aten.max_pool3d_with_indices", 7),
    "aten.adaptive_max_pool2d_backward": ("aten.adaptive_max_pool2d", 2),
    "aten.adaptive_max_pool3d_backward": ("aten.adaptive_max_pool3d", 2),
})

_SCALED_EMBEDDING = "aten.embedding_dense_backward"   # argument 4: scale_grad_by_freq
_FIX = "leave the op out, or run the function in an embedded pw.Context (a single user), where it is allowed"


class ServiceGraphError(ValueError):
    """A graph from a service client that names an op refused to strangers sharing the executors."""


def check_service_graph(graph) -> None:
    """Refuse (`ServiceGraphError`, naming the node, the op, why and the fix) a function graph (``pb.Graph``) of a
    service client that names an op in `SERVICE_REFUSED`, a max-pool backward whose indices are not straight from
    its forward op (`TRUSTED_INDICES`), or ``embedding_dense_backward`` with ``scale_grad_by_freq``."""
    nodes = list(graph.nodes)
    users = _users_of(nodes)
    for node in nodes:
        if node.op != "call_function":
            continue
        family = node.target.rpartition(".")[0]
        where = f"node {node.name} ({node.target})"
        if family in SERVICE_REFUSED:
            raise ServiceGraphError(f"{where}: refused to a service client: {SERVICE_REFUSED[family]}; {_FIX}")
        if family in TRUSTED_INDICES:
            _check_indices_from_forward(node, family, nodes, users, where)
        if family == _SCALED_EMBEDDING and not _is_literal_false(_argument(node, 4, "scale_grad_by_freq")):
            raise ServiceGraphError(
                f"{where}: refused to a service client with scale_grad_by_freq=True: it counts per index without "
                f"checking the index (measured on CPU: a segmentation fault of the executor process); expected "
                f"scale_grad_by_freq=False (nn.Embedding's default), or {_FIX}")


def _check_indices_from_forward(node, family: str, nodes, users, where: str) -> None:
    forward_family, position = TRUSTED_INDICES[family]
    indices = _argument(node, position, "indices")
    source = nodes[indices.node] if _is_node(indices, nodes) else None
    forward = nodes[source.args[0].node] if source is not None and _is_getitem(source, 1, nodes) else None
    problem = None
    if forward is None or forward.target != f"{forward_family}.default":
        problem = f"expected its indices to be output 1 of {forward_family}.default in the same graph"
    elif not _same_node(_argument(forward, 0, "self"), _argument(node, 1, "self")):
        problem = f"expected its self to be the input of {forward.name}, whose indices it takes"
    elif any(not _is_getitem(nodes[user], 0, nodes) and user != indices.node for user in users.get(
            source.args[0].node, ())):
        problem = f"expected {forward.name}'s indices to be taken once ({source.name})"
    elif any(not _reads_indices(nodes[user], indices.node) for user in users.get(indices.node, ())):
        problem = f"expected {source.name} to be used by max-pool backward ops alone (nothing may change it first)"
    if problem is not None:
        raise ServiceGraphError(
            f"{where}: refused to a service client: it indexes with its indices unchecked (measured on CPU with "
            f"made-up ones: a segmentation fault of the executor process); {problem}; compute the backward in the "
            f"same function as its forward (as a traced training step does), or {_FIX}")


def _reads_indices(user, index: int) -> bool:
    """Whether ``user`` (a node using the indices node ``index``) only reads them: a max-pool backward taking them
    as its indices, or the graph's output."""
    if user.op == "output":
        return True
    family = user.target.rpartition(".")[0]
    if family not in TRUSTED_INDICES:
        return False
    refs = [i for i, arg in enumerate(user.args) if _refers(arg, index)]
    refs += [named.name for named in user.kwargs if _refers(named.value, index)]
    return refs in ([TRUSTED_INDICES[family][1]], ["indices"])


def _users_of(nodes) -> dict[int, list[int]]:
    users: dict[int, list[int]] = {}
    for position, node in enumerate(nodes):
        for arg in [*node.args, *(named.value for named in node.kwargs)]:
            for ref in _refs(arg):
                users.setdefault(ref, []).append(position)
    return users


def _refs(arg):
    kind = arg.WhichOneof("kind")
    if kind == "node":
        yield arg.node
    elif kind == "list":
        for item in arg.list.items:
            yield from _refs(item)


def _refers(arg, index: int) -> bool:
    return index in set(_refs(arg))


def _argument(node, position: int, name: str):
    if position < len(node.args):
        return node.args[position]
    return next((named.value for named in node.kwargs if named.name == name), None)


def _is_node(arg, nodes) -> bool:
    return arg is not None and arg.WhichOneof("kind") == "node" and arg.node < len(nodes)


def _same_node(a, b) -> bool:
    return a is not None and b is not None and a.WhichOneof("kind") == b.WhichOneof("kind") == "node" and \
        a.node == b.node


def _is_getitem(node, item: int, nodes) -> bool:
    return (node.op == "call_function" and node.target == "operator.getitem" and len(node.args) == 2
            and _is_node(node.args[0], nodes) and node.args[1].WhichOneof("kind") == "int_value"
            and node.args[1].int_value == item)


def _is_literal_false(arg) -> bool:
    return arg is not None and arg.WhichOneof("kind") == "bool_value" and not arg.bool_value
