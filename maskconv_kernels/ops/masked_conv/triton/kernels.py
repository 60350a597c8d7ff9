"""The Triton kernels: forward, input gradient and weight gradient of a 2-D masked conv.

Every kernel is an implicit GEMM whose reduction runs over the *active* taps only:
``TAPS`` is a ``tl.constexpr`` tuple of ``(kh, kw, flat_tap)`` triples, and the forward
and input gradient run one loop over (active tap, channel block) pairs whose tap is the
``t``-th of ``TAPS`` (``_tap``), so a masked tap is never named: it has no load and no
product. One flat loop, not one per tap, lets Triton pipeline loads across taps and
keeps the code (and the compile time) independent of the number of taps.
Borders, padding, strides and channel counts that are not block multiples are handled
by masked loads (``other=0``) of *active* taps only; nothing is ever multiplied by a
zeroed weight. Index arithmetic is int64 from the first program id on, so tensors beyond
2^31 elements address correctly. Accumulation is float32 in every kernel.

Layouts (channels-last, contiguous; 1-D problems arrive as ``H = KH = 1``):
``x: [N, H, W, C_IN]``, ``w: [KH, KW, C_IN, C_OUT]``, ``y / dy: [N, OH, OW, C_OUT]``.
Output tap ``(kh, kw)`` of output pixel ``(oh, ow)`` reads input pixel
``(oh * SH - PH + kh * DH, ow * SW - PW + kw * DW)``.

This module imports ``triton``; only :mod:`.ops` imports it, and
only when a Triton kernel is launched or compiled.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["conv_fwd_kernel", "conv_dx_kernel", "conv_dw_kernel"]


@triton.jit
def _tap(t, TAPS: tl.constexpr, TAP_RUN: tl.constexpr, KW: tl.constexpr):
    """``(kh, kw)`` of the ``t``-th active tap.

    ``TAP_RUN >= 0``: the active taps are the raster run of flat indices ``TAP_RUN ..
    TAP_RUN + len(TAPS) - 1`` (PixelCNN, causal and stack masks), a division. Otherwise
    a chain of ``len(TAPS)`` scalar selects.
    """
    if TAP_RUN >= 0:
        f = t + TAP_RUN
        kh = f // KW
        kw = f % KW
    else:
        kh = t * 0
        kw = t * 0
        for i in tl.static_range(len(TAPS)):
            kh = tl.where(t == i, TAPS[i][0], kh)
            kw = tl.where(t == i, TAPS[i][1], kw)
    return kh, kw


@triton.jit
def _block(pid, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``pid`` of ``range(SIZE)`` in int64, and which of its lanes are in range."""
    idx = tl.cast(pid, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return idx, idx < SIZE


@triton.jit
def _unflatten(m, H: tl.constexpr, W: tl.constexpr):
    """Flat pixel indices of ``[N, H, W]`` as (image, row, column)."""
    return m // (W * H), (m // W) % H, m % W


@triton.jit
def _pixels(pid, N: tl.constexpr, H: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    """Block ``pid`` of the ``N * H * W`` flat pixels: (flat index, in range, image, row, column)."""
    m, m_ok = _block(pid, N * H * W, BLOCK)
    n, row, col = _unflatten(m, H, W)
    return m, m_ok, n, row, col


@triton.jit
def _input_row(n, oh, ow, ok, kh, kw, H: tl.constexpr, W: tl.constexpr, C_IN: tl.constexpr,
               SH: tl.constexpr, SW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
               PH: tl.constexpr, PW: tl.constexpr):
    """Element offset of the ``x`` row tap ``(kh, kw)`` of output pixels ``(n, oh, ow)`` reads,
    and ``ok`` narrowed to those inside the image (padding reads nothing)."""
    ih = oh * SH - PH + kh * DH
    iw = ow * SW - PW + kw * DW
    return ((n * H + ih) * W + iw) * C_IN, ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)


@triton.jit
def conv_fwd_kernel(
    x_ptr,  # [N, H, W, C_IN]
    w_ptr,  # [KH, KW, C_IN, C_OUT]
    y_ptr,  # [N, OH, OW, C_OUT]
    N: tl.constexpr, H: tl.constexpr, W: tl.constexpr, C_IN: tl.constexpr,
    OH: tl.constexpr, OW: tl.constexpr, C_OUT: tl.constexpr,
    SH: tl.constexpr, SW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr,
    TAPS: tl.constexpr,  # ((kh, kw, kh * KW + kw), ...) active taps only
    TAP_RUN: tl.constexpr,  # first flat tap when TAPS is a raster run, else -1
    KW: tl.constexpr,  # window width
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee", "tf32" or "tf32x3"
    BLOCK_M: tl.constexpr,  # output pixels per program
    BLOCK_N: tl.constexpr,  # output channels per program
    BLOCK_K: tl.constexpr,  # input channels per dot
):
    """``y[m, co] = sum_{active taps} sum_ci x[pixel(m, tap), ci] * w[tap, ci, co]``; grid (M tiles, C_OUT tiles)."""
    K_TILES: tl.constexpr = (C_IN + BLOCK_K - 1) // BLOCK_K
    m, m_ok, n, oh, ow = _pixels(tl.program_id(0), N, OH, OW, BLOCK_M)
    co, co_ok = _block(tl.program_id(1), C_OUT, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(len(TAPS) * K_TILES):
        kh, kw = _tap(it // K_TILES, TAPS, TAP_RUN, KW)
        x_row, ok = _input_row(n, oh, ow, m_ok, kh, kw, H, W, C_IN, SH, SW, DH, DW, PH, PW)
        w_tap = w_ptr + (kh * KW + kw).to(tl.int64) * C_IN * C_OUT
        ci, ci_ok = _block(it % K_TILES, C_IN, BLOCK_K)
        a = tl.load(x_ptr + x_row[:, None] + ci[None, :], mask=ok[:, None] & ci_ok[None, :], other=0.0)
        b = tl.load(w_tap + ci[:, None] * C_OUT + co[None, :], mask=ci_ok[:, None] & co_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = y_ptr + m[:, None] * C_OUT + co[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & co_ok[None, :])


@triton.jit
def conv_dx_kernel(
    dy_ptr,  # [N, OH, OW, C_OUT]
    w_ptr,  # [KH, KW, C_IN, C_OUT]
    dx_ptr,  # [N, H, W, C_IN]
    N: tl.constexpr, H: tl.constexpr, W: tl.constexpr, C_IN: tl.constexpr,
    OH: tl.constexpr, OW: tl.constexpr, C_OUT: tl.constexpr,
    SH: tl.constexpr, SW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr,
    TAPS: tl.constexpr,
    TAP_RUN: tl.constexpr,
    KW: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # input pixels per program
    BLOCK_N: tl.constexpr,  # input channels per program
    BLOCK_K: tl.constexpr,  # output channels per dot
):
    """The transposed problem: ``dx[p, ci] = sum_{active taps} sum_co dy[out(p, tap), co] * w[tap, ci, co]``.

    Input pixel ``(ih, iw)`` receives from tap ``(kh, kw)`` the output pixel with
    ``oh * SH = ih + PH - kh * DH`` when that is a non-negative multiple of ``SH`` below
    ``OH * SH`` (likewise for w): the flipped tap, with strides and dilation. An input
    reachable only through masked taps matches no active tap and keeps its exact zero.
    Grid (input pixel tiles, C_IN tiles).
    """
    K_TILES: tl.constexpr = (C_OUT + BLOCK_K - 1) // BLOCK_K
    m, m_ok, n, ih, iw = _pixels(tl.program_id(0), N, H, W, BLOCK_M)
    ci, ci_ok = _block(tl.program_id(1), C_IN, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(len(TAPS) * K_TILES):
        kh, kw = _tap(it // K_TILES, TAPS, TAP_RUN, KW)
        th = ih + PH - kh * DH
        tw = iw + PW - kw * DW
        # Guard the sign before dividing: integer division truncates toward zero.
        th = tl.where(th >= 0, th, -SH)
        tw = tl.where(tw >= 0, tw, -SW)
        oh = th // SH
        ow = tw // SW
        ok = m_ok & (oh >= 0) & (oh < OH) & (ow >= 0) & (ow < OW) & (oh * SH == th) & (ow * SW == tw)
        dy_row = ((n * OH + oh) * OW + ow) * C_OUT
        w_tap = w_ptr + (kh * KW + kw).to(tl.int64) * C_IN * C_OUT
        co, co_ok = _block(it % K_TILES, C_OUT, BLOCK_K)
        a = tl.load(dy_ptr + dy_row[:, None] + co[None, :], mask=ok[:, None] & co_ok[None, :], other=0.0)
        # w[tap] read as its transpose [C_OUT block, C_IN block].
        b = tl.load(w_tap + ci[None, :] * C_OUT + co[:, None], mask=co_ok[:, None] & ci_ok[None, :], other=0.0)
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)
    out = dx_ptr + m[:, None] * C_IN + ci[None, :]
    tl.store(out, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & ci_ok[None, :])


@triton.jit
def conv_dw_kernel(
    x_ptr,  # [N, H, W, C_IN]
    dy_ptr,  # [N, OH, OW, C_OUT]
    dw_ptr,  # [SPLIT, len(TAPS), C_IN, C_OUT] float32 partial sums
    N: tl.constexpr, H: tl.constexpr, W: tl.constexpr, C_IN: tl.constexpr,
    OH: tl.constexpr, OW: tl.constexpr, C_OUT: tl.constexpr,
    SH: tl.constexpr, SW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr,
    TAPS: tl.constexpr,
    TAP_RUN: tl.constexpr,
    KW: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # input channels per program
    BLOCK_N: tl.constexpr,  # output channels per program
    BLOCK_K: tl.constexpr,  # output pixels per dot
    CHUNK: tl.constexpr,  # output pixels per split, a multiple of BLOCK_K
):
    """``dw[s, j, ci, co] = sum_{pixels m in split s} x[pixel(m, tap j), ci] * dy[m, co]``.

    Grid (C_IN tiles * C_OUT tiles, active taps, splits). Every partial sum is owned by
    one program and reduced in a fixed order, and the splits are added in a fixed order
    by the caller: no atomics, the same bits run to run. Masked taps have no program.
    """
    n_co_tiles: tl.constexpr = (C_OUT + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.program_id(2).to(tl.int64)
    ci, ci_ok = _block(pid // n_co_tiles, C_IN, BLOCK_M)
    co, co_ok = _block(pid % n_co_tiles, C_OUT, BLOCK_N)
    kh, kw = _tap(j, TAPS, TAP_RUN, KW)
    start = s * CHUNK
    stop = tl.minimum(start + CHUNK, N * OH * OW)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, CHUNK, BLOCK_K):
        m = start + p0 + tl.arange(0, BLOCK_K)
        m_ok = m < stop
        n, oh, ow = _unflatten(m, OH, OW)
        x_row, ok = _input_row(n, oh, ow, m_ok, kh, kw, H, W, C_IN, SH, SW, DH, DW, PH, PW)
        a = tl.load(x_ptr + ci[:, None] + x_row[None, :], mask=ci_ok[:, None] & ok[None, :], other=0.0)
        b = tl.load(dy_ptr + m[:, None] * C_OUT + co[None, :], mask=m_ok[:, None] & co_ok[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
    out = dw_ptr + ((s * len(TAPS) + j) * C_IN + ci[:, None]) * C_OUT + co[None, :]
    tl.store(out, acc, mask=ci_ok[:, None] & co_ok[None, :])
