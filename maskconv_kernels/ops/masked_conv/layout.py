"""The caller's layout around the one problem every backend computes.

``lax.conv_general_dilated`` takes its operands in any dimension order
(``dimension_numbers``), inserts zeros between input pixels (``lhs_dilation``: a
transposed convolution) and can split the batch into groups (``batch_group_count``).
The backends compute one problem: ``x: (N, *spatial, C_in)``, ``kernel: (*window,
C_in // groups, C_out)``, ``out: (N, *out_spatial, C_out)``. A :class:`Layout` maps the
caller's arrays onto it and the output back:

* transposes into channels-last and back (the mask too: a window-shaped mask follows
  the kernel's spatial dims, a full one the kernel's layout);
* batch groups folded into feature groups: lax's group ``g`` (examples ``g * N / G`` to
  ``(g + 1) * N / G``, output channels ``g * C_out / G`` onwards) becomes input channels
  ``g * C_in`` onwards of ``N / G`` examples, which feature group ``g`` reads;
* input dilation written as interior zero padding (``lax.pad``), to which the padding
  then applies, as in lax.

Each step moves values or inserts constant zeros: no masked tap is read, so the
exactness contract holds through a layout. Input dilation is computed on the dilated
input, zeros included: ``prod(lhs_dilation)`` times the work of the undilated problem.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...masks import Mask

__all__ = ["Layout"]


def _dilate_dim(n: int, d: int) -> int:
    return 0 if n == 0 else (n - 1) * d + 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """The caller's layout of one convolution (validated by :func:`.spec.make_spec`).

    Attributes:
      lhs: axes of ``x`` holding ``(N, C, *spatial)`` (lax's ``ConvDimensionNumbers.lhs_spec``).
      rhs: axes of the kernel holding ``(O, I, *spatial)``. The spatial dims are in lax's
        order, the one ``strides``, ``padding`` and the dilations are given in.
      out: axes of the output holding ``(N, C, *spatial)``.
      lhs_dilation: input dilation per spatial dim.
      batch_groups: ``batch_group_count``.
    """

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    out: tuple[int, ...]
    lhs_dilation: tuple[int, ...]
    batch_groups: int = 1

    @classmethod
    def channels_last(cls, ndim: int) -> "Layout":
        """``x: (N, *spatial, C)``, ``kernel: (*window, I, O)``, no dilation, no batch groups."""
        spatial = tuple(range(1, ndim + 1))
        return cls((0, ndim + 1, *spatial), (ndim + 1, ndim, *range(ndim)), (0, ndim + 1, *spatial), (1,) * ndim)

    @classmethod
    def channels_first(cls, ndim: int) -> "Layout":
        """lax's default (``dimension_numbers=None``): ``("NCHW", "OIHW", "NCHW")`` in 2-D."""
        order = tuple(range(ndim + 2))
        return cls(order, order, order, (1,) * ndim)

    @property
    def ndim(self) -> int:
        return len(self.lhs) - 2

    @property
    def is_channels_last(self) -> bool:
        """Whether this is the backends' own problem: every step below is the identity."""
        return self == Layout.channels_last(self.ndim)

    # ------------------------------------------------------------------ permutations

    @property
    def x_perm(self) -> tuple[int, ...]:
        """``x.transpose(x_perm)`` is ``(N, *spatial, C)``."""
        return (self.lhs[0], *self.lhs[2:], self.lhs[1])

    @property
    def kernel_perm(self) -> tuple[int, ...]:
        """``kernel.transpose(kernel_perm)`` is ``(*window, I, O)``; also a full mask's."""
        return (*self.rhs[2:], self.rhs[1], self.rhs[0])

    @property
    def window_perm(self) -> tuple[int, ...]:
        """``mask.transpose(window_perm)`` puts a window-shaped mask, whose axes follow the
        kernel's spatial axes in the kernel's own order, in lax's spatial order."""
        in_kernel_order = sorted(self.rhs[2:])
        return tuple(in_kernel_order.index(d) for d in self.rhs[2:])

    @property
    def out_perm(self) -> tuple[int, ...]:
        """``y.transpose(out_perm)`` takes a channels-last output ``(N, *spatial, C)`` to the caller's layout."""
        position = {0: 0, 1: self.ndim + 1, **{2 + i: 1 + i for i in range(self.ndim)}}  # lax's dim -> channels-last axis
        return tuple(position[self.out.index(axis)] for axis in range(self.ndim + 2))

    # ------------------------------------------------------------------ shapes

    def x_shape(self, shape) -> tuple[int, ...]:
        """The shape :meth:`x` gives for an ``x`` of ``shape``."""
        n, c, g = shape[self.lhs[0]], shape[self.lhs[1]], self.batch_groups
        spatial = (_dilate_dim(shape[a], d) for a, d in zip(self.lhs[2:], self.lhs_dilation))
        return (n // g, *spatial, g * c)

    def kernel_shape(self, shape) -> tuple[int, ...]:
        return tuple(shape[a] for a in self.kernel_perm)

    def segment_ids_shape(self, x_shape) -> tuple[int, ...]:
        """The shape ``segment_ids`` have for an ``x`` of ``x_shape``: x's without its channel axis."""
        return tuple(n for axis, n in enumerate(x_shape) if axis != self.lhs[1])

    # ------------------------------------------------------------------ arrays

    def x(self, x: jax.Array) -> jax.Array:
        """The caller's ``x`` as the backends' ``(N / G, *dilated spatial, G * C)``."""
        x = _transpose(x, self.x_perm)
        g = self.batch_groups
        if g > 1:
            n, *spatial, c = x.shape
            x = jnp.moveaxis(x.reshape(g, n // g, *spatial, c), 0, -2).reshape(n // g, *spatial, g * c)
        if any(d > 1 for d in self.lhs_dilation):
            interior = [(0, 0, 0), *((0, 0, d - 1) for d in self.lhs_dilation), (0, 0, 0)]
            x = lax.pad(x, jnp.zeros((), x.dtype), interior)
        return x

    def kernel(self, kernel: jax.Array) -> jax.Array:
        """The caller's kernel as ``(*window, I, O)``."""
        return _transpose(kernel, self.kernel_perm)

    def segment_ids(self, ids: jax.Array) -> jax.Array:
        """The caller's ``segment_ids`` (x's layout without its channel axis) as ``(N, *spatial)``."""
        below = lambda axis: axis - (axis > self.lhs[1])  # noqa: E731  the axis once the channels are gone
        return _transpose(ids, (below(self.lhs[0]), *map(below, self.lhs[2:])))

    def output(self, y: jax.Array) -> jax.Array:
        """A channels-last output in the caller's layout."""
        return _transpose(y, self.out_perm)

    def mask(self, mask):
        """The caller's mask in the backends' order: a full mask (the kernel's rank) as the
        kernel, a window-shaped one as the window; a :class:`Mask` is in that order already.

        Anything else (a traced value, a wrong shape) is left to :func:`maskconv_kernels.masks.as_mask`,
        which says what is wrong.
        """
        if self.is_channels_last or isinstance(mask, (Mask, jax.core.Tracer)) or mask is None:
            return mask
        try:
            bits = np.asarray(mask)
        except Exception:  # not array-like: as_mask says so
            return mask
        if bits.ndim == self.ndim + 2:
            return bits.transpose(self.kernel_perm)
        if bits.ndim == self.ndim:
            return bits.transpose(self.window_perm)
        return mask


def _transpose(a, perm):
    return a if tuple(perm) == tuple(range(a.ndim)) else jnp.transpose(a, perm)
