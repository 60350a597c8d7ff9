"""``causal_conv``'s problem: its arguments checked once, in its own words, into a frozen :class:`Problem`.

Everything after the checks is channels-last: ``x (N, T, *spatial, C_in)``, ``kernel
(k_T, *k_spatial, C_in // groups, C_out)``, ``segment_ids (N, T, *spatial)``; the
caller's ``dimension_numbers`` are a :class:`~maskconv_kernels.ops.masked_conv.layout.Layout`
applied on the way in and out. Time is the first spatial axis.

Two padding modes, because time and the other axes take different ones: time's
(``padding_mode``) fills the frames before frame 0 and can only copy frame 0 (a reflected
or wrapped time axis would read later frames); the other axes' (``spatial_padding_mode``,
the name LTX-Video's and LTX-2's ``CausalConv3d`` give it) may mirror, repeat or wrap the
frame's own pixels, as PyTorch's ``Conv3d(padding_mode=...)`` does.

The problem carries the :class:`~maskconv_kernels.ops.masked_conv.spec.ConvSpec` of the
convolution it runs (time padded ``((k_T - 1) * d_T, 0)``, the caller's padding on the
other axes, or none on frames that :meth:`Problem.pad_spatial` padded with copies; every
tap active), which is what ``masked_conv``'s implementations are asked
about: an implementation that cannot take it says why, and ``causal_conv`` says it.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ..._core.args import as_operand, as_segment_ids, float_dtype, ints, is_int, padding_pairs
from ..._core.errors import OpError
from ..._modules import pad_with_copies
from ..masked_conv.layout import Layout
from ..masked_conv.spec import ConvSpec, make_layout, make_spec

__all__ = ["PADDING_MODES", "SPATIAL_PADDING_MODES", "Problem", "make_problem"]

PADDING_MODES = ("zeros", "replicate")
# The other axes' modes, PyTorch's names; each copying one is a jnp.pad mode of the frame.
SPATIAL_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


@dataclasses.dataclass(frozen=True)
class Problem:
    """Everything static about one causal convolution along time (hashable).

    Shapes are channels-last. ``strides[0]``, ``dilation[0]`` and ``window[0]`` are
    time's; ``pads`` the other axes' ``(lo, hi)`` pairs. For :func:`causal_conv_transpose`
    (``transposed``) ``strides[0]`` is the upsampling factor and ``spec`` is the
    convolution of its first phase (:mod:`.phases`).
    """

    batch: int
    frames: int
    spatial: tuple[int, ...]  # the non-time spatial sizes
    c_in: int
    c_out: int
    window: tuple[int, ...]
    strides: tuple[int, ...]
    dilation: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]
    padding_mode: str
    spatial_padding_mode: str
    groups: int
    segmented: bool
    has_bias: bool
    transposed: bool
    x_dtype: np.dtype
    kernel_dtype: np.dtype
    bias_dtype: np.dtype | None
    acc_dtype: np.dtype
    precision: object
    layout: Layout  # the caller's layout (dimension_numbers)
    spec: ConvSpec  # the convolution masked_conv runs, channels-last

    @property
    def ndim(self) -> int:
        """Spatial axes, time included (1: audio, 2: spectrograms, 3: video)."""
        return len(self.window)

    @property
    def stride(self) -> int:
        return self.strides[0]

    @property
    def context(self) -> int:
        """How many frames before an output's own the convolution reads: ``(k_T - 1) * d_T``."""
        return (self.window[0] - 1) * self.dilation[0]

    def frame_shape(self) -> tuple[int, ...]:
        """One frame of x, channels-last, without the batch: ``(*spatial, C_in)``."""
        return (*self.spatial, self.c_in)

    @property
    def copies_pixels(self) -> bool:
        """Whether the other axes are padded with copies of the frame's pixels (not zeros)."""
        return self.spatial_padding_mode != "zeros" and any(lo or hi for lo, hi in self.pads)

    @property
    def conv_pads(self) -> tuple[tuple[int, int], ...]:
        """The other axes' ``(lo, hi)`` as the convolution applies them: the caller's zeros, or
        none where :meth:`pad_spatial` padded the frames with copies first."""
        return tuple((0, 0) for _ in self.pads) if self.copies_pixels else self.pads

    def pad_spatial(self, x):
        """``x (N, T', *spatial, C)`` with the other axes padded by ``spatial_padding_mode``.

        A copying mode is ``jnp.pad`` of each frame on its own axes: every value it adds is
        a pixel of the same frame (mirrored, repeated or wrapped), so no frame reads
        another, causality along time is untouched, and a stream pads each chunk's frames
        as the full pass pads them. Its transpose adds each copy's gradient to the pixel
        it copies. With zeros, ``x`` as it is: the convolution pads.
        """
        if not self.copies_pixels:
            return x
        return pad_with_copies(x, self.pads, self.spatial_padding_mode, 2)


def make_problem(
    op: str,
    x,
    kernel,
    bias=None,
    segment_ids=None,
    *,
    strides=1,
    dilation=1,
    padding="SAME",
    padding_mode="zeros",
    spatial_padding_mode="zeros",
    feature_group_count=1,
    dimension_numbers=None,
    precision=None,
    transposed: bool = False,
):
    """The arguments checked: ``(problem, x, kernel, bias, segment_ids)``, channels-last arrays.

    ``op`` names the function in every error (``"causal_conv"``, ``"causal_conv_stream"``,
    ...). The arrays may be tracers; shapes and dtypes are checked, values are not.
    """
    err = OpError(op)
    with err.words():
        x, kernel = as_operand("x", x), as_operand("kernel", kernel)
        bias = None if bias is None else as_operand("bias", bias)
    if len(x.shape) not in (3, 4, 5):
        hint = ": x needs a batch axis and a channel axis, x[None, :, None] gives (1, T, 1)" if len(x.shape) == 1 else (
            ": x needs a batch axis (x[None]) or a channel axis (x[..., None])" if len(x.shape) == 2 else "")
        raise err.value(
            f"x must be (N, T, *spatial, C_in), channels-last, with time and at most two more spatial axes "
            f"(rank 3 to 5: audio (N, T, C), spectrograms (N, T, F, C), video (N, T, H, W, C)), got shape "
            f"{tuple(x.shape)}{hint}"
        )
    if padding_mode not in PADDING_MODES:
        raise err.value(
            f"padding_mode must be 'zeros' (frames before 0 are zeros) or 'replicate' (copies of frame 0), got "
            f"{padding_mode!r}" + (
                ": 'reflect' reads frames after 0, which a causal convolution must not see" if padding_mode in (
                    "reflect", "circular", "symmetric") else ""))
    _check_spatial_padding_mode(err, spatial_padding_mode)
    ndim = len(x.shape) - 2
    if len(kernel.shape) != ndim + 2:
        raise err.value(
            f"kernel must be (k_T, *k_spatial, C_in // groups, C_out) with {ndim} window axes to match x of shape "
            f"{tuple(x.shape)}, got shape {tuple(kernel.shape)}"
        )
    try:
        # The caller's layout first: the padding pairs need the channels-last window.
        layout = make_layout(x.shape, kernel.shape, dimension_numbers)
    except (TypeError, ValueError) as e:
        raise err.reworded(e) from None
    x_shape, k_shape = layout.x_shape(x.shape), layout.kernel_shape(kernel.shape)
    window = tuple(int(k) for k in k_shape[:-2])
    batch, frames, *spatial = (int(n) for n in x_shape[:-1])
    if frames < 1:
        raise err.value(f"x needs at least one frame (time is axis 1 of (N, T, *spatial, C_in)), got shape "
                        f"{tuple(x.shape)}")
    padding = _causal_padding(err, padding, ndim)
    if transposed and is_int(strides):
        strides = (strides, *(1,) * (ndim - 1))  # an upsampling factor for time; the other axes keep stride 1
    try:
        strides_ = ints("strides", strides, ndim)
        dilation_ = ints("dilation", dilation, ndim)
        pads = padding_pairs(
            padding, window[1:], strides=strides_[1:], dilation=dilation_[1:], in_spatial=tuple(spatial),
            names=("SAME", "VALID"),
        )
    except (TypeError, ValueError) as e:
        raise err.reworded(e) from None
    if transposed:
        if any(s != 1 for s in strides_[1:]):
            raise err.value(
                f"strides={strides!r}: the transposed convolution upsamples time only (strides[0] frames out per "
                "frame in); the other axes take stride 1"
            )
        if dilation_[0] != 1:
            raise err.value(f"dilation={dilation!r}: the transposed convolution takes no time dilation "
                            "(dilation[0] must be 1); the other axes may be dilated")
    c_in, c_out = int(x_shape[-1]), int(k_shape[-1])
    if bias is not None and tuple(bias.shape) != (c_out,):
        raise err.value(f"bias must be (C_out,) = ({c_out},), got shape {tuple(bias.shape)}")
    bias_dtype = None
    if bias is not None:
        try:
            bias_dtype = float_dtype("bias must have", bias.dtype)
        except TypeError as e:
            raise err.reworded(e) from None
    ids = None
    if segment_ids is not None:
        try:
            ids = layout.segment_ids(as_segment_ids(segment_ids, layout.segment_ids_shape(x.shape)))
        except (TypeError, ValueError) as e:
            raise err.reworded(e) from None
        _check_segmented(err, strides_, pads, window, dilation_, padding_mode, spatial_padding_mode, transposed)
    _check_copied_pads(err, spatial_padding_mode, pads)
    k_spec = kernel
    if transposed:
        # What the implementations are asked about: a phase's stride-1 causal convolution.
        first_phase = -(-window[0] // strides_[0])
        k_spec = jax.ShapeDtypeStruct(
            tuple(first_phase if axis == layout.rhs[2] else n for axis, n in enumerate(kernel.shape)), kernel.dtype)
        spec_strides, context = (1, *strides_[1:]), first_phase - 1
    else:
        spec_strides, context = strides_, (window[0] - 1) * dilation_[0]
    try:
        # The one ConvSpec of the call, in the caller's layout (its errors say how x and the
        # kernel were read): dtypes, channels, groups, precision; every tap active.
        spec = make_spec(
            x, k_spec, None, strides=spec_strides, dilation=dilation_,
            padding=((context, 0), *pads), feature_group_count=feature_group_count, precision=precision,
            dimension_numbers=dimension_numbers, segmented=ids is not None,
        )
    except (TypeError, ValueError) as e:
        raise err.reworded(e) from None
    # Channels-last, and the output in the accumulation dtype: rounded once, after the bias.
    acc = spec.acc_dtype
    spec = dataclasses.replace(spec.channels_last(), out_dtype=acc)
    problem = Problem(
        batch=batch, frames=frames, spatial=tuple(spatial), c_in=c_in, c_out=c_out, window=window,
        strides=strides_, dilation=dilation_, pads=pads, padding_mode=padding_mode,
        spatial_padding_mode=spatial_padding_mode,
        groups=int(feature_group_count), segmented=ids is not None, has_bias=bias is not None,
        transposed=bool(transposed), x_dtype=np.dtype(x.dtype), kernel_dtype=np.dtype(kernel.dtype),
        bias_dtype=bias_dtype, acc_dtype=acc, precision=spec.precision, layout=layout, spec=spec,
    )
    if problem.copies_pixels:
        # What the implementations are asked about is the convolution they run: the frames
        # padded with copies (pad_spatial), and no padding of their own on those axes.
        padded = tuple(n + lo + hi for n, (lo, hi) in zip(spatial, pads))
        spec = spec.resized((spec.in_spatial[0], *padded), (spec.padding[0], *problem.conv_pads))
        problem = dataclasses.replace(problem, spec=spec)
    return problem, layout.x(x), layout.kernel(kernel), bias, ids


def _causal_padding(err: OpError, padding, ndim: int):
    """``padding="CAUSAL"``, the word ``nn.Conv`` users bring, read as what it means here.

    In ``nn.Conv`` it is time's padding (output ``t`` sees inputs up to ``t``, 1-D only),
    which this op always applies; ``padding`` here is the other axes'. A 1-D layer has
    none, so ``"CAUSAL"`` says exactly what the layer does (``"VALID"``: nothing to pad);
    with other axes it cannot say how to pad them, and the error names what can.
    """
    if not (isinstance(padding, str) and padding.upper() == "CAUSAL"):
        return padding
    if ndim == 1:
        return "VALID"
    raise err.value(
        f"padding='CAUSAL' is nn.Conv's padding of a 1-D convolution's time axis, which this layer always pads "
        f"causally; here padding is the other {ndim - 1} spatial axes' and 'CAUSAL' cannot say how to pad them: pass "
        "'SAME' (the default, frame size kept), 'VALID' or one (lo, hi) pair per non-time axis"
    )


def _check_spatial_padding_mode(err: OpError, mode) -> None:
    if mode in SPATIAL_PADDING_MODES:
        return
    hint = ""
    if isinstance(mode, str) and mode.lower() in SPATIAL_PADDING_MODES:
        hint = f": the modes are lower-case, {mode.lower()!r}"
    elif mode in ("edge", "wrap", "symmetric"):
        hint = " (jnp.pad's 'edge' is 'replicate' and 'wrap' is 'circular'; 'symmetric' is not offered)"
    raise err.value(
        "spatial_padding_mode pads the axes after time, each frame on its own: 'zeros' (the default), 'reflect', "
        f"'replicate' or 'circular' (PyTorch's names), got {mode!r}{hint}"
    )


def _check_copied_pads(err: OpError, mode: str, pads) -> None:
    """A copying mode adds pixels: negative pads (a crop) are the convolution's alone, with zeros."""
    if mode != "zeros" and any(lo < 0 or hi < 0 for lo, hi in pads):
        raise err.value(
            f"spatial_padding_mode={mode!r} pads with copies of pixels, which a negative pad (a crop) cannot take, "
            f"got pads {pads}: crop x first, or pad with spatial_padding_mode='zeros'"
        )


def _check_segmented(err, strides, pads, window, dilation, padding_mode, spatial_padding_mode, transposed) -> None:
    """Packed clips need an output per input frame and pixel, each with its input's clip."""
    if spatial_padding_mode != "zeros" and any(lo or hi for lo, hi in pads):
        raise err.value(
            f"segment_ids take spatial_padding_mode='zeros', got {spatial_padding_mode!r}: the segment ids name x's "
            "positions, and a copied border pixel belongs to none of them; run the clips one by one, or pad the other "
            "axes with zeros"
        )
    if padding_mode != "zeros":
        raise err.value(
            "segment_ids take padding_mode='zeros' (a clip's first frames see zeros before it, as when it runs "
            "alone); with 'replicate' they would need copies of each clip's own first frame: run the clips one "
            "by one, or pack them with 'zeros'"
        )
    if not transposed and strides[0] != 1:
        raise err.value(
            f"segment_ids need strides[0] = 1 (output frame t belongs to the clip of input frame t), got strides "
            f"{strides}: a strided layer of packed clips would need each clip to start on a multiple of the stride"
        )
    if any(s != 1 for s in strides[1:]) or any(
        lo + hi != (k - 1) * d for (lo, hi), k, d in zip(pads, window[1:], dilation[1:])
    ):
        raise err.value(
            "segment_ids name x's positions, so the other axes need an output on the input's grid: strides 1 and "
            f"padding='SAME' (or pairs summing to the dilated window - 1), got strides {strides} and pads {pads}"
        )
