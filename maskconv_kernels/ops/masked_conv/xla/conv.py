"""The exact pure-JAX backend: a masked convolution as a sum over dense active pieces.

The mask is split once into :class:`~maskconv_kernels.masks.Term` s, each a box of
taps that is active for a set of (input, output) channels. Each of the three linear
maps (forward, input gradient, weight gradient) is computed by one of four strategies,
chosen per map and per platform when the function is lowered (:class:`Config`):

* ``"conv"``: ``lax.conv_general_dilated`` over each term's sub-kernel, with the padding
  shifted to the box's offset (boxes of one or two taps use the im2col GEMM below).
  XLA's CPU and TPU convolutions are direct convolutions, so an output reads only the
  inputs under its box; the NaN-isolation tests prove it there (:data:`DIRECT_CONVOLUTION`).
  What CPUs run (the weight gradient from 128 x 128 channels excepted: :func:`cpu_strategy`)
  and what TPUs run.
* ``"gemm"`` and ``"conv_blocks"`` (:mod:`.blocks`): each map
  written out over blocks of pixels, so that a block stays in cache and the extra
  memory is one block's; ``"gemm"`` as GEMMs over an im2col of every active tap (all
  boxes in one GEMM), ``"conv_blocks"`` as one convolution per box (its weight gradient
  is ``"gemm"``'s). Ungrouped problems without segment ids, and stride 1 for the input
  gradient; elsewhere the platform's other strategy.
* ``"matmul"``: an im2col of each box's taps (strided slices of the padded input)
  contracted with ``dot_general``. Only multiplies and adds of active taps, so it is
  exact on every platform; it is what GPUs run, where a convolution call may pick
  Winograd or FFT and mix neighbouring windows.

With ``"conv"`` and ``"matmul"`` the gradients are the transposes of the same pieces.
Whatever the strategy, a depthwise problem (``feature_group_count == C_in > 1``) is
:mod:`.depthwise`'s sum of shifted products, and a problem with
``segment_ids`` is im2col GEMMs whose columns are selected by document (a convolution
cannot select).
Masked taps are never read by any strategy, so the gradients never write to inputs
reachable only through masked taps and leave masked kernel entries at exactly zero.
Differentiation, batching and the per-platform choice are
:mod:`..maps`'s, shared with the kernel backends.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...._core.primitives import zeros_varying
from ...._moved import renamed_attributes
from ....masks import Mask, Term
from ..spec import ConvSpec
from . import blocks, depthwise
from .blocks import take  # a[..., indices] as a slice where contiguous

__all__ = [
    "Config", "STRATEGIES", "MAPS", "DIRECT_CONVOLUTION", "cpu_strategy", "unsupported", "forward", "input_grad",
    "weight_grad",
]

STRATEGIES = ("auto", "conv", "matmul", *blocks.STRATEGIES)
MAPS = ("forward", "input_grad", "weight_grad")


@dataclasses.dataclass(frozen=True)
class Config:
    """The ``xla`` backend's config: how each linear map is computed.

    ``strategy``: for every map, one of ``"auto"`` (:func:`cpu_strategy` when lowered
    for CPU, ``"conv"`` for a TPU, ``"matmul"`` for a GPU), ``"conv"``, ``"matmul"``,
    ``"gemm"`` or ``"conv_blocks"`` (the module's docstring says what each is).
    ``forward``, ``input_grad``, ``weight_grad``: that map's strategy, overriding
    ``strategy`` (``None``: ``strategy``'s). The blocked strategies run on CPU only; where
    they do not apply (feature groups, segment ids; strides, for the input gradient, or
    another platform) they fall back to ``"conv"`` on CPU and TPU and ``"matmul"`` on
    GPUs; ``"conv"`` lowered for a GPU is ``"matmul"``.
    ``block_bytes``: the blocked strategies' im2col patches per block of pixels
    (``None``: :data:`.blocks.BLOCK_BYTES`).
    """

    strategy: str = "auto"
    forward: str | None = None
    input_grad: str | None = None
    weight_grad: str | None = None
    block_bytes: int | None = None

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Config.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for kind in MAPS:
            value = getattr(self, kind)
            if value is not None and value not in STRATEGIES:
                raise ValueError(f"Config.{kind} must be None or one of {STRATEGIES}, got {value!r}")
        if self.block_bytes is not None and (
            not isinstance(self.block_bytes, int) or isinstance(self.block_bytes, bool) or self.block_bytes < 1
        ):
            raise ValueError(f"Config.block_bytes must be None or a positive int, got {self.block_bytes!r}")


# Its name before every backend's config was Config: warns, until _moved.REMOVED_IN.
__getattr__ = renamed_attributes(__name__, {"XlaConfig": "Config"})


def unsupported(spec: ConvSpec, platform: str | None, interpret: bool = False) -> str | None:
    """The pure-JAX backend runs every problem on every platform."""
    return None


def cpu_strategy(spec: ConvSpec, kind: str) -> str:
    """What ``"auto"`` runs for map ``kind`` lowered for CPU: ``"conv"`` for every map but the
    weight gradient from 128 x 128 channels, which is ``"gemm"``.

    Why: a blocked strategy runs one block at a time in a ``lax.scan``, which leaves cores
    idle, so the per-box convolutions win the forward and the input gradient; XLA's
    transpose of them for the weight gradient falls behind the GEMMs once channels are
    wide. The measurements are in the documentation's design notes (the CPU strategies).
    """
    if kind == "weight_grad" and spec.c_in * spec.c_out >= _GEMM_WEIGHT_GRAD_CHANNELS:
        return "gemm"
    return "conv"


# The weight gradient's GEMMs win from C_in x C_out = 128 x 128 (3x3 type B, WaveNet);
# at 64 x 64 XLA's transposed convolution is as fast or faster.
_GEMM_WEIGHT_GRAD_CHANNELS = 128 * 128


# The platforms whose XLA convolution reads only the inputs under its window (a direct
# convolution, no Winograd or FFT), as the NaN-isolation and leak checks prove there:
# XLA:CPU's, and the TPU's (measured on a TPU v5e on the benchmark's timed executables,
# docs/design/tpu.md). On GPUs cuDNN may pick Winograd or FFT: they never get one.
DIRECT_CONVOLUTION = ("cpu", "tpu")


def _strategy(job, kind: str) -> str:
    """The strategy of map ``kind`` (one of :data:`MAPS`) for the job's lowering platform."""
    config = job.config or Config()
    strategy = getattr(config, kind) or config.strategy
    # Decided per lowering platform, so a function lowered for a GPU never holds a
    # convolution (which may run Winograd or FFT there and mix masked taps in).
    direct = job.platform in DIRECT_CONVOLUTION
    other = "conv" if direct else "matmul"
    if strategy == "auto":
        strategy = cpu_strategy(job.spec, kind) if job.platform == "cpu" else other
    if strategy in blocks.STRATEGIES and (job.platform != "cpu" or blocks.unsupported(job.spec, kind)):
        return other  # the blocked strategies are the CPU's (a block at a time in a lax.scan)
    if strategy == "conv":
        return other
    return strategy


def _block_bytes(job) -> int:
    return (job.config or Config()).block_bytes or blocks.BLOCK_BYTES


def _blocks_dtype(job, a, b):
    """The dtype the blocked strategies' GEMMs and convolutions read ``a`` and ``b`` in
    (their sums are in ``acc_dtype``)."""
    if job.platform == "cpu":
        # XLA:CPU's dot thunk rejects BF16 x BF16 = F32 where its YNNPACK fusion does not
        # take the dot (jaxlib 0.10.2: the small dots of a channel-partial mask's pieces).
        # Widening 16-bit values is exact, and each block is widened in cache.
        return job.spec.acc_dtype
    return jnp.promote_types(a.dtype, b.dtype)


# The three maps that maskconv_kernels.ops.masked_conv.maps lowers. The forward is linear
# in each argument: its transposes are the exact gradients, built from the same active pieces
# (and nothing else).


def forward(x, kernel, job, out_dtype, segment_ids=None):
    """``(N, *out_spatial, C_out)`` from ``x: (N, *spatial, C_in)`` and the kernel."""
    spec, strategy, fenced = job.spec, _strategy(job, "forward"), _fenced(job, out_dtype)
    wide = spec.acc_dtype if fenced else spec.dtype  # XLA:CPU's convolution widens 16 bits anyway
    x, kernel = _arrive(fenced, x, kernel)
    kernel = _read(kernel, spec.kernel_dtype, wide)
    if strategy in blocks.STRATEGIES:  # x is widened a block at a time, in cache
        x = _read(x, spec.x_dtype, spec.dtype)
        y = blocks.forward(x, kernel, spec, strategy, _blocks_dtype(job, x, kernel), _block_bytes(job))
    else:
        y = _forward(_read(x, spec.x_dtype, wide), kernel, spec, strategy, segment_ids)
    return _round(fenced, y, out_dtype)


# The gradients are the transposes of the forward, taken in the accumulation dtype. A
# transpose returns a cotangent in its primal's dtype, so transposing at a 16-bit primal
# rounds each piece's (and, through an im2col, each tap's) share to 16 bits before the
# shares are added, in 16 bits. At a float32 primal with the other operand upcast
# (exact: 16-bit values and their products are exact in float32, as lax's own transposes
# upcast), the shares are summed in float32 and the result is rounded once. The "gemm"
# and "conv_blocks" strategies' maps accumulate every piece and block in float32 themselves.


def input_grad(dy, kernel, job, out_dtype, segment_ids=None):
    """``dx: (N, *spatial, C_in)`` from ``dy: (N, *out_spatial, C_out)``, rounded once from float32."""
    spec, strategy, acc, fenced = job.spec, _strategy(job, "input_grad"), job.spec.acc_dtype, _fenced(job, out_dtype)
    dy, kernel = _arrive(fenced, dy, kernel)
    if strategy in blocks.STRATEGIES:
        kernel = _read(kernel, spec.kernel_dtype, acc if fenced else spec.dtype)
        dy = _read(dy, spec.out_dtype, spec.out_dtype)
        dx = blocks.input_grad(dy, kernel, spec, strategy, _blocks_dtype(job, dy, kernel), _block_bytes(job))
        return _round(fenced, dx, out_dtype)
    x = zeros_varying((dy.shape[0], *spec.in_spatial, spec.c_in), acc, dy)
    kernel, dy = _read(kernel, spec.kernel_dtype, acc), _read(dy, spec.out_dtype, acc)
    (dx,) = jax.linear_transpose(lambda x_: _forward(x_, kernel, spec, strategy, segment_ids), x)(dy)
    return _round(fenced, dx, out_dtype)


def weight_grad(x, dy, job, out_dtype, segment_ids=None):
    """``dk: (*window, C_in // groups, C_out)``, exactly zero on masked entries (never computed)."""
    spec, strategy, acc, fenced = job.spec, _strategy(job, "weight_grad"), job.spec.acc_dtype, _fenced(job, out_dtype)
    x, dy = _arrive(fenced, x, dy)
    if strategy in blocks.STRATEGIES:  # "conv_blocks" too: a convolution's weight gradient is the slow one
        x, dy = _read(x, spec.x_dtype, spec.dtype), _read(dy, spec.out_dtype, spec.out_dtype)
        dk = blocks.weight_grad(x, dy, spec, _blocks_dtype(job, x, dy), _block_bytes(job))
        return _round(fenced, dk, out_dtype)
    kernel = zeros_varying((*spec.window, spec.c_in // spec.groups, spec.c_out), acc, dy)
    x, dy = _read(x, spec.x_dtype, acc), _read(dy, spec.out_dtype, acc)
    (dk,) = jax.linear_transpose(lambda k_: _forward(x, k_, spec, strategy, segment_ids), kernel)(dy)
    return _round(fenced, dk, out_dtype)


# jaxlib 0.12.1's CPU compiler aborts the process ("LLVM ERROR: Cannot select: v8bf16 =
# X86ISD::VBROADCAST") on some loop fusions that write 16-bit values after moving data:
# a slice of a transposed bfloat16 array (jnp.transpose(bf16[5, 8])[:4]), or float32 pads
# and adds rounded to bfloat16 (a weight gradient's taps). So on CPU a map that computes
# or returns 16-bit values is fenced: its operands arrive materialized (a caller's layout
# transpose stays a transpose of its own), pieces are cut from them in float32, and the
# float32 result is rounded by a convert of its own. Exact (widening is), at no measured
# cost (docs/design/cpu_16bit_abort.md).


def _fenced(job, out_dtype) -> bool:
    """Whether the map is fenced: lowered for CPU, with a 16-bit compute dtype (x's and the
    kernel's, promoted) or result."""
    narrowest = min(np.dtype(job.spec.dtype).itemsize, np.dtype(out_dtype).itemsize)
    return job.platform == "cpu" and narrowest < 4


def _arrive(fenced: bool, a, b):
    """The two operands, materialized before any piece is cut from them where fenced."""
    return lax.optimization_barrier((a, b)) if fenced else (a, b)


def _round(fenced: bool, y, out_dtype):
    """``y`` (accumulation dtype) rounded once to ``out_dtype``, by a convert of its own where fenced."""
    if not fenced:
        return y.astype(out_dtype)
    return lax.optimization_barrier(lax.optimization_barrier(y).astype(out_dtype))


def _read(a, dtype, wide):
    """``a`` as the problem reads it (rounded to its operand's ``dtype``), then widened (exactly) to ``wide``."""
    return a.astype(dtype).astype(wide)


def _forward(x, kernel, spec: ConvSpec, strategy: str, segment_ids=None):
    """The sum of the mask's pieces, in the accumulation dtype (the caller rounds it once)."""
    if depthwise.is_depthwise(spec):
        acc = spec.acc_dtype
        return depthwise.forward(x.astype(acc), kernel.astype(acc), spec, segment_ids)
    if spec.mask.is_full and spec.groups > 1:
        return _per_group(x, kernel, spec, strategy, segment_ids)
    batch = x.shape[0]
    out = jnp.zeros((batch, *spec.out_spatial, spec.c_out), spec.acc_dtype)
    terms = spec.mask.terms
    # A select inside a convolution is not possible: segmented problems are im2col GEMMs.
    select = None if segment_ids is None else depthwise.segment_selects(segment_ids, spec)
    for term in terms:
        small = len(term.box.taps()) < _MIN_CONV_TAPS and len(terms) > 1
        xs = x if term.in_channels is None else take(x, term.in_channels, axis=-1)
        ks = _sub_kernel(kernel, term)
        if strategy == "conv" and not small and select is None:
            y = _term_conv(xs, ks, term, spec)
        else:
            y = _term_matmul(xs, ks, term, spec, select)
        out = out + y if term.out_channels is None else out.at[..., term.out_channels].add(y)
    return out


# XLA:CPU's convolution of a 1- or 2-tap window costs about what a 3-tap one does, so
# such small boxes beside others go through the im2col GEMM even on the "conv"
# strategy. A lone box (WaveNet's 2 taps) stays a convolution: the GEMM's patch copy
# costs more than it saves there (docs/design/cpu_strategies.md).
_MIN_CONV_TAPS = 3


def _per_group(x, kernel, spec: ConvSpec, strategy: str, segment_ids=None):
    """Channel-partial masks with feature groups: each group is its own ungrouped problem."""
    cig, cog = spec.c_in // spec.groups, spec.c_out // spec.groups
    outs = []
    for g in range(spec.groups):
        sub = spec.mask.bits[..., g * cog : (g + 1) * cog]
        sub_spec = _replace_mask(spec, sub, c_in=cig, c_out=cog, groups=1)
        outs.append(
            _forward(
                x[..., g * cig : (g + 1) * cig], kernel[..., g * cog : (g + 1) * cog], sub_spec, strategy, segment_ids
            )
        )
    return jnp.concatenate(outs, axis=-1)


def _replace_mask(spec, bits, **changes):
    return dataclasses.replace(spec, mask=Mask(spec.window, bits), **changes)


def _sub_kernel(kernel, term: Term):
    box = tuple(slice(s, s + n) for s, n in zip(term.box.start, term.box.size))
    ks = kernel[box]
    if term.in_channels is not None:
        ks = take(ks, term.in_channels, axis=-2)
    if term.out_channels is not None:
        ks = take(ks, term.out_channels, axis=-1)
    return ks


def _box_padding(term: Term, spec: ConvSpec):
    """The padding that makes a conv over the box's sub-kernel align with the full window.

    Tap ``k = start + j`` reads input ``i * stride - lo + k * dilation``: the same as a
    conv over the box with ``lo' = lo - start * dilation``; ``hi'`` keeps the output size.
    """
    return tuple(
        (lo - s * d, hi - (k - s - n) * d)
        for (lo, hi), s, n, k, d in zip(spec.padding, term.box.start, term.box.size, spec.window, spec.dilation)
    )


def _safe_conv_padding(xs, pads, box_size, dilation):
    """The input and padding for a convolution whose low padding lies in ``[0, window - 1]``.

    jaxlib 0.10's CPU convolution reads garbage (values up to 1e35, changing from run
    to run, some at future pixels) when a low padding is negative: in the forward pass
    if ``lo < 0``, and in the input gradient, whose low padding is ``window - 1 - lo``,
    if ``lo >= window``. A box's padding is often both (a 1x2 box of a 1x5 type-A
    mask: ``lo = 2``); found by the causality audit. So a negative ``lo`` or ``hi``
    becomes a crop of the input, and ``lo`` beyond ``window - 1`` an explicit zero pad:
    the same products, and their transposes are a zero pad and a crop, no convolution.
    Returns ``(None, None)`` when the crop leaves nothing: every output of the box then
    reads padding only.
    """
    spatial = xs.shape[1:-1]
    starts = [max(-lo, 0) for lo, _ in pads]
    limits = [n - max(-hi, 0) for n, (_, hi) in zip(spatial, pads)]
    if any(start >= limit for start, limit in zip(starts, limits)):
        return None, None
    if any(starts) or list(spatial) != limits:
        xs = lax.slice(xs, (0, *starts, 0), (xs.shape[0], *limits, xs.shape[-1]))
    windows = [d * (n - 1) + 1 for n, d in zip(box_size, dilation)]
    extra = [max(lo - (w - 1), 0) for (lo, _), w in zip(pads, windows)]
    if any(extra):
        xs = lax.pad(xs, jnp.zeros((), xs.dtype), ((0, 0, 0), *((e, 0, 0) for e in extra), (0, 0, 0)))
    return xs, tuple((max(lo, 0) - e, max(hi, 0)) for (lo, hi), e in zip(pads, extra))


def _term_conv(xs, ks, term: Term, spec: ConvSpec):
    groups = spec.groups if term.in_channels is None else 1
    cropped, pads = _safe_conv_padding(xs, _box_padding(term, spec), term.box.size, spec.dilation)
    if cropped is None:
        return jnp.zeros((xs.shape[0], *spec.out_spatial, ks.shape[-1]), spec.acc_dtype)
    return lax.conv_general_dilated(
        cropped,
        ks,
        window_strides=spec.strides,
        padding=pads,
        rhs_dilation=spec.dilation,
        dimension_numbers=spec.dimension_numbers,
        feature_group_count=groups,
        precision=spec.precision,
        preferred_element_type=spec.acc_dtype,
    )


def _term_matmul(xs, ks, term: Term, spec: ConvSpec, select=None):
    """im2col over the box's taps (strided views of the padded input), then one dot.

    ``select``: ``tap -> bool`` (:func:`depthwise.segment_selects`), where a tap may read
    its input; elsewhere its column holds a selected zero.
    """
    ndim = spec.ndim
    pads = _box_padding(term, spec)
    xp = lax.pad(xs, jnp.zeros((), xs.dtype), ((0, 0, 0), *((lo, hi, 0) for lo, hi in pads), (0, 0, 0)))
    out_spatial = spec.out_spatial
    cols = []
    for tap in term.box.taps():
        j = tuple(t - s for t, s in zip(tap, term.box.start))
        start = (0, *(jj * d for jj, d in zip(j, spec.dilation)), 0)
        limit = (
            xp.shape[0],
            *(st + (o - 1) * s + 1 for st, o, s in zip(start[1:-1], out_spatial, spec.strides)),
            xp.shape[-1],
        )
        col = lax.slice(xp, start, limit, (1, *spec.strides, 1))
        cols.append(col if select is None else jnp.where(select(tap), col, jnp.zeros((), col.dtype)))
    groups = spec.groups if term.in_channels is None else 1
    n_taps = len(cols)
    patches = jnp.stack(cols, axis=-2)  # (N, *out, taps, C_in)
    c_in = patches.shape[-1]
    k = ks.reshape(n_taps, ks.shape[-2], ks.shape[-1])  # (taps, C_in/g, C_out)
    if groups == 1:
        patches = patches.reshape(*patches.shape[:-2], n_taps * c_in)
        return lax.dot_general(
            patches, k.reshape(n_taps * c_in, -1), (((ndim + 1,), (0,)), ((), ())),
            precision=spec.precision, preferred_element_type=spec.acc_dtype,
        )
    cig, cog = c_in // groups, ks.shape[-1] // groups
    # (N, *out, taps, G, cig) x (G, taps, cig, cog) -> (G, N, *out, cog)
    patches = patches.reshape(*patches.shape[:-1], groups, cig)
    kg = k.reshape(n_taps, cig, groups, cog).transpose(2, 0, 1, 3)
    y = lax.dot_general(
        patches, kg, (((ndim + 1, ndim + 3), (1, 2)), ((ndim + 2,), (0,))),
        precision=spec.precision, preferred_element_type=spec.acc_dtype,
    )
    y = jnp.moveaxis(y, 0, -2)  # (N, *out, G, cog)
    return y.reshape(*y.shape[:-2], groups * cog)
