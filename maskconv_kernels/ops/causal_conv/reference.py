"""Float64 NumPy oracles of :func:`~maskconv_kernels.causal_conv` and
:func:`~maskconv_kernels.causal_conv_transpose`, written from their definitions: a loop
over taps, each gathering the input frames and pixels it reads (or nothing).

Channels-last only (``dimension_numbers`` is a transposition around them). Outputs are
float64.
"""
from __future__ import annotations

import numpy as np

from ..._core.args import padding_pairs

__all__ = ["causal_conv_reference", "causal_conv_transpose_reference"]


def _per_axis(value, ndim: int) -> tuple[int, ...]:
    return (int(value),) * ndim if np.ndim(value) == 0 else tuple(int(v) for v in value)


# spatial_padding_mode's copying modes as NumPy's np.pad names them.
_NUMPY_MODES = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _spatial_sources(sizes, window, strides, dilation, pads, tap, mode="zeros"):
    """Per non-time axis: ``(index, valid)`` of the input pixel each output pixel reads through ``tap``.

    Outside the frame a pixel is zero (``mode="zeros"``: not valid) or, for a copying
    mode, the pixel of the same frame that ``np.pad(mode=...)`` puts there.
    """
    out = []
    for n, k, s, d, (lo, hi), j in zip(sizes, window, strides, dilation, pads, tap):
        o = (n + lo + hi - d * (k - 1) - 1) // s + 1
        source = np.arange(max(o, 0)) * s - lo + j * d
        if mode == "zeros":
            out.append((np.clip(source, 0, n - 1), (source >= 0) & (source < n)))
        else:  # pixel `source` of the frame padded by (lo, hi) copies is pixel copied[source + lo] of the frame
            copied = np.pad(np.arange(n), (lo, hi), mode=_NUMPY_MODES[mode])
            out.append((copied[source + lo], np.ones(len(source), bool)))
    return out


def _gather(a, t_index, spatial, first_axis=1):
    a = np.take(a, t_index, axis=first_axis)
    for axis, (index, _) in enumerate(spatial):
        a = np.take(a, index, axis=first_axis + 1 + axis)
    return a


def _valid(t_valid, spatial):
    """``(T', *out_spatial)``: the outer product of the per-axis validities."""
    v = t_valid
    for _, valid in spatial:
        v = v[..., None] & valid
    return v


def _tap_product(x_taps, k_tap, groups: int):
    """``(..., C_out)``: ``x_taps (..., C_in) @ k_tap (C_in // groups, C_out)`` per feature group."""
    c_in, c_out = x_taps.shape[-1], k_tap.shape[-1]
    xg = x_taps.reshape(*x_taps.shape[:-1], groups, c_in // groups)
    kg = k_tap.reshape(c_in // groups, groups, c_out // groups)
    return np.einsum("...gi,igo->...go", xg, kg).reshape(*x_taps.shape[:-1], c_out)


def _add_tap(y, x, k_tap, t_index, t_valid, spatial, ids, out_ids, groups):
    """``y`` plus one tap's products: frame ``t_index`` (where ``t_valid``) at each axis' pixel
    (where valid), in the output's clip (``out_ids``) when there are clips."""
    valid = _valid(t_valid, spatial)
    valid = np.broadcast_to(valid, (x.shape[0], *valid.shape))
    if ids is not None:
        valid = valid & (_gather(ids, t_index, spatial) == out_ids)
    term = np.where(valid[..., None], _tap_product(_gather(x, t_index, spatial), k_tap, groups), 0.0)
    return term if y is None else y + term


def _finish(y, bias, out_ids):
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if out_ids is not None:
        y = np.where((out_ids >= 0)[..., None], y, 0.0)
    return y


def _resolved(x, kernel, strides, dilation, padding):
    ndim = x.ndim - 2
    window = kernel.shape[:-2]
    s, d = _per_axis(strides, ndim), _per_axis(dilation, ndim)
    pads = padding_pairs(padding, window[1:], strides=s[1:], dilation=d[1:], in_spatial=x.shape[2:-1],
                         names=("SAME", "VALID"))
    return window, s, d, pads


def causal_conv_reference(
    x, kernel, bias=None, *, strides=1, dilation=1, padding="SAME", padding_mode="zeros", spatial_padding_mode="zeros",
    feature_group_count=1, segment_ids=None,
):
    """Float64 oracle of :func:`causal_conv` (channels-last arguments, same meaning).

    Output frame ``t`` at pixel ``o`` sums, over taps ``(j, *taps)``, input frame ``t * s_T
    - (k_T - 1) * d_T + j * d_T`` (before frame 0: zeros, or frame 0 for ``"replicate"``)
    at pixel ``o * s - lo + tap * d`` (outside: zeros, or the pixel ``np.pad`` copies there
    for a copying ``spatial_padding_mode``) times the tap's kernel; with
    ``segment_ids``, only inputs of the output's clip (output ``(t, o)`` is in input
    ``(t, o)``'s), and outputs of negative ids are zero.
    """
    x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
    window, s, d, pads = _resolved(x, kernel, strides, dilation, padding)
    frames = x.shape[1]
    context = (window[0] - 1) * d[0]
    out_frames = (frames - 1) // s[0] + 1
    ids = None if segment_ids is None else np.asarray(segment_ids, np.int64)
    y = None
    for tap in np.ndindex(*window):
        source = np.arange(out_frames) * s[0] - context + tap[0] * d[0]
        t_valid = source >= 0 if padding_mode == "zeros" else np.ones(out_frames, bool)
        t_index = np.clip(source, 0, frames - 1)
        spatial = _spatial_sources(x.shape[2:-1], window[1:], s[1:], d[1:], pads, tap[1:], spatial_padding_mode)
        y = _add_tap(y, x, kernel[tap], t_index, t_valid, spatial, ids, ids, feature_group_count)
    return _finish(y, bias, ids)


def causal_conv_transpose_reference(
    x, kernel, bias=None, *, strides=1, dilation=1, padding="SAME", padding_mode="zeros", spatial_padding_mode="zeros",
    feature_group_count=1, segment_ids=None,
):
    """Float64 oracle of :func:`causal_conv_transpose` (channels-last arguments, same meaning).

    Input frame ``t`` adds, through time tap ``j``, its stride-1 convolution over the
    other axes with ``kernel[j]`` to output frame ``t * s_T + j``, for the outputs
    ``u < T * s_T``; frames before 0 add nothing (``"zeros"``) or frame 0's (``"replicate"``);
    the other axes are padded as :func:`causal_conv_reference` pads them.
    With ``segment_ids`` output ``u`` belongs to input frame ``u // s_T``'s clip and takes
    inputs of that clip only.
    """
    x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
    if np.ndim(strides) == 0:
        strides = (int(strides), *(1,) * (x.ndim - 3))  # time's factor; the other axes stride 1
    window, s, d, pads = _resolved(x, kernel, strides, dilation, padding)
    factor = s[0]
    frames = x.shape[1]
    out = frames * factor
    ids = None if segment_ids is None else np.asarray(segment_ids, np.int64)
    out_ids = None if ids is None else np.repeat(ids, factor, axis=1)
    y = None
    for tap in np.ndindex(*window):
        u = np.arange(out)
        source = u - tap[0]  # = t * s for the input frame t that writes u through this tap
        writes = source % factor == 0
        t = source // factor
        t_valid = writes & ((t >= 0) if padding_mode == "zeros" else np.ones(out, bool))
        t_index = np.clip(t, 0, frames - 1)
        spatial = _spatial_sources(x.shape[2:-1], window[1:], s[1:], d[1:], pads, tap[1:], spatial_padding_mode)
        y = _add_tap(y, x, kernel[tap], t_index, t_valid, spatial, ids, out_ids, feature_group_count)
    return _finish(y, bias, out_ids)
