"""``aten.convolution_backward`` for torchax, as the vector-Jacobian product of torchax's own forward.

torchax lowers ``aten.convolution`` (to ``jax.lax.conv_general_dilated``) but not its
backward, so every CNN training step ran its convolution gradients outside XLA (3 ops
in a residual block, measured). The backward here is ``jax.vjp`` of that same forward,
so it holds for every stride, padding, dilation, group count and transposed form the
forward does; the bias gradient is the output gradient summed over all but the
channel dimension.
"""

from __future__ import annotations

__all__ = ["convolution_backward"]


def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    """A jax function (jax arrays in and out) with ``aten.convolution_backward``'s signature."""
    import jax
    from torchax.ops import jaten

    def forward(x, w):
        return jaten._aten_convolution(x, w, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(forward, input, weight)
    grad_input, grad_weight = vjp(grad_output)
    grad_bias = grad_output.sum(axis=(0, *range(2, grad_output.ndim))) if output_mask[2] else None
    return (grad_input if output_mask[0] else None, grad_weight if output_mask[1] else None, grad_bias)
