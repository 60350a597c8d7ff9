"""The Mosaic GPU kernels of ``causal_conv1d(implementation="pallas_mosaic_gpu")``.

A depthwise causal conv of width 2 to 8 is a few multiply-adds per element read: no
matmul, so no TMA pipeline and no wgmma, only one warpgroup per tile holding it in the
WGMMA register layout (64 rows by 8 columns per register block), loaded straight from
global memory and stored back. Three ``plgpu.kernel`` bodies, on channels-last arrays:

* ``causal_conv1d_mgpu_fwd``: one ``[positions, channels]`` tile of ``y``: the taps
  (each a load of the tile shifted back by ``(W-1-t) * dilation`` positions), bias, SiLU
  and the padding select in float32, one rounding to x's dtype;
* ``causal_conv1d_mgpu_bwd_pre``: the cotangent of the pre-activation, ``g = dy *
  SiLU'(pre)`` (the pre-activation recomputed, no residual but the inputs), float32, 0 at
  padding;
* ``causal_conv1d_mgpu_bwd``: one tile of the input gradient ``dx[q] = sum_t w[t] *
  g[q + (W-1-t) * dilation]`` (the state's positions included: its gradient), and the
  tile's weight and bias gradients summed over its positions, float32 partial sums
  added afterwards in a fixed order (no atomics: the same bits run to run).

The wrapper lays the operands out on an **extended** position axis, ``F`` positions
(the state's ``S = (W-1) * dilation``, rounded up to whole tiles) before the sequence
and ``F`` after its tiles, with one segment id per position: the ids given (0 without),
the row's first document's id at the state's positions (the state belongs to it), -1
where nothing is. So every load is in bounds and a kernel has no edge case: tap ``t`` of
output ``p`` reads input ``q`` only where ``ids[q] == ids[p] >= 0``, kept or dropped by a
``where`` select, never multiplied by a 0/1 mask: a NaN in one document changes no
other's output, and the gradient across documents is exactly 0.0. Padding outputs
(negative ids) are zeros, bias and activation included.

The op's primitives (:mod:`maskconv_kernels._core.fused`) lower :func:`forward` and
:func:`backward` and give them derivatives of every order.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from ...._core.tiling import cdiv, round_up
from .config import KERNELS, Config

__all__ = ["Static", "forward", "backward"]

# One warpgroup's register layouts: a tile, its rows (one value per position) and its
# columns (one per channel); a row or column vector broadcasts to the tile.
_TILE = plgpu.Layout.WGMMA
_ROWS = plgpu.Layout.WGMMA.reduce(1)
_COLUMNS = plgpu.Layout.WGMMA.reduce(0)
_GRID = ("row", "tile", "block")
_NOTHING = -1  # the segment id where no input is (past the row, before a missing state)


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything a kernel is specialised on but the shapes (hashable)."""

    width: int
    dilation: int
    silu: bool
    positions: int  # rows of a tile
    channels: int  # columns of a tile
    front: int  # F: positions before the sequence on the extended axis (whole tiles, >= S)

    def back(self, t: int) -> int:
        """How far before an output its tap ``t`` reads."""
        return (self.width - 1 - t) * self.dilation


# --------------------------------------------------------------------------- loads


def _load(ref, layout):
    # Global memory: Mosaic GPU's optimised (swizzled) transfers are for shared memory only.
    return plgpu.load(ref, layout=layout, optimized=False)


def _store(ref, value):
    """``ref[...] = value`` in global memory, unoptimised (no swizzled, whole-sector transfer plan).

    jax >= 0.12 writes ``ref[...] =`` as a swap that reads the old value with the optimised
    plan, which a tile of 16-bit channels (16 bytes a row) does not meet; its
    ``plgpu.store`` takes ``optimized=False``. jax 0.11 has no ``plgpu.store`` and needs none.
    """
    if hasattr(plgpu, "store"):
        plgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value


def _tile(ref, b, e, c0, s: Static):
    """float32 ``[positions, channels]`` of ``ref[b, e:e + positions, c0:c0 + channels]``."""
    value = _load(ref.at[b, pl.ds(e, s.positions), pl.ds(c0, s.channels)], _TILE)
    return value.astype(jnp.float32)


def _ids(ref, b, e, s: Static):
    """int32 ``[positions]``: the segment ids of positions ``e...`` (one per row of a tile)."""
    return _load(ref.at[b, pl.ds(e, s.positions)], _ROWS)


def _rows(mask, s: Static):
    """A ``[positions]`` mask broadcast to a tile's ``[positions, channels]``: the selects are
    computed on one id per position, not per element."""
    return lax.broadcast_in_dim(mask, (s.positions, s.channels), (0,))


def _vector(ref, index, c0, s: Static):
    """float32 ``[positions, channels]``: ``ref[index..., c0:c0 + channels]`` in every row."""
    value = _load(ref.at[(*index, pl.ds(c0, s.channels))], _COLUMNS)
    return lax.broadcast_in_dim(value, (s.positions, s.channels), (1,))


def _indices(s: Static, front: int):
    """``(row b, extended position e0 of the tile, first channel c0)`` of this program."""
    b, tile, block = (lax.axis_index(name) for name in _GRID)
    return b, front + tile * s.positions, block * s.channels


def _pre(x_ref, ids_ref, w_ref, bias_ref, b, e0, c0, s: Static):
    """``(pre, live)`` at outputs ``e0...``: ``bias + sum_t w[t] * x[p - back(t)]`` over the taps read,
    float32, and where outputs are not padding."""
    doc = _ids(ids_ref, b, e0, s)
    live = doc >= 0
    pre = _vector(bias_ref, (), c0, s)
    for t in range(s.width):
        e = e0 - s.back(t)
        reads = _rows((_ids(ids_ref, b, e, s) == doc) & live, s)
        pre = pre + jnp.where(reads, _vector(w_ref, (t,), c0, s) * _tile(x_ref, b, e, c0, s), 0.0)
    return pre, _rows(live, s)


# --------------------------------------------------------------------------- kernels


def _forward_kernel(x_ref, ids_ref, w_ref, bias_ref, y_ref, *, s: Static):
    """One tile of ``y = act(pre) where ids >= 0``.

    Refs: x ``[B, N, Dp]`` (x's dtype) and ids ``[B, N]`` int32 on the extended axis, w
    ``[W, Dp]`` and bias ``[Dp]`` float32; y ``[B, Lt, Dp]`` in x's dtype (``Lt``: whole
    tiles). Program ``(b, tile, block)``.
    """
    b, e0, c0 = _indices(s, s.front)
    pre, live = _pre(x_ref, ids_ref, w_ref, bias_ref, b, e0, c0, s)
    y = pre * jax.nn.sigmoid(pre) if s.silu else pre
    y = jnp.where(live, y, 0.0)  # padding outputs are zeros, bias and activation included
    _store(y_ref.at[b, pl.ds(e0 - s.front, s.positions), pl.ds(c0, s.channels)], y.astype(y_ref.dtype))


def _pre_grad_kernel(x_ref, ids_ref, w_ref, bias_ref, dy_ref, g_ref, *, s: Static):
    """One tile of the pre-activation's cotangent ``g = dy * act'(pre)``, 0 at padding.

    Refs: as :func:`_forward_kernel`'s, then dy ``[B, Lt, Dp]`` (x's dtype); g ``[B, Lt,
    Dp]`` float32. Without SiLU no tap is read: ``g`` is ``dy`` selected.
    """
    b, e0, c0 = _indices(s, s.front)
    l0 = e0 - s.front
    g = _tile(dy_ref, b, l0, c0, s)
    if s.silu:
        pre, live = _pre(x_ref, ids_ref, w_ref, bias_ref, b, e0, c0, s)
        sig = jax.nn.sigmoid(pre)
        g = g * (sig * (1.0 + pre * (1.0 - sig)))
    else:
        live = _rows(_ids(ids_ref, b, e0, s) >= 0, s)
    _store(g_ref.at[b, pl.ds(l0, s.positions), pl.ds(c0, s.channels)], jnp.where(live, g, 0.0))


def _backward_kernel(x_ref, ids_ref, w_ref, g_ref, dx_ref, dw_ref, db_ref, *, s: Static):
    """One tile of the input gradient on the extended axis, and its weight and bias gradients.

    Refs: x ``[B, N, Dp]``, ids ``[B, N]`` as the forward's; w ``[W, Dp]`` float32; g ``[B,
    N, Dp]`` float32 on the extended axis (0 outside the sequence); dx ``[B, F + Lt, Dp]`` in
    x's dtype (the state's gradient at ``F - S .. F``); dw ``[B, tiles, W, Dp]`` and db ``[B,
    tiles, Dp]`` float32 partial sums. Program ``(b, tile, block)``, tiles from position 0.

    ``dx[q] = sum_t w[t] * g[q + back(t)]`` and ``dw[t] += x[q] * g[q + back(t)]``, each term
    where output ``q + back(t)`` reads input ``q``: one document, not padding.
    """
    b, e0, c0 = _indices(s, 0)
    tile = lax.axis_index(_GRID[1])
    doc = _ids(ids_ref, b, e0, s)
    x = _tile(x_ref, b, e0, c0, s)
    dx = jnp.zeros((s.positions, s.channels), jnp.float32)
    for t in range(s.width):
        e = e0 + s.back(t)
        out_doc = _ids(ids_ref, b, e, s)
        reads = _rows((out_doc == doc) & (out_doc >= 0), s)
        g = _tile(g_ref, b, e, c0, s)
        dx = dx + jnp.where(reads, _vector(w_ref, (t,), c0, s) * g, 0.0)
        _store(dw_ref.at[b, tile, t, pl.ds(c0, s.channels)], jnp.sum(jnp.where(reads, x * g, 0.0), axis=0))
        if s.back(t) == 0:  # g is 0 but at live outputs: the bias gradient sums it
            _store(db_ref.at[b, tile, pl.ds(c0, s.channels)], jnp.sum(g, axis=0))
    _store(dx_ref.at[b, pl.ds(e0, s.positions), pl.ds(c0, s.channels)], dx.astype(dx_ref.dtype))


# --------------------------------------------------------------------------- launches


def _launch(body, name: str, s: Static, grid, out_type, interpret: bool):
    return plgpu.kernel(
        functools.partial(body, s=s),
        out_type=out_type,
        grid=grid,
        grid_names=_GRID,
        # Lane semantics: the layouts written here are the layouts used.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=name,
    )


def _static(problem, config: Config, backward: bool) -> Static:
    positions, channels = config.tile(backward)
    return Static(
        width=problem.width, dilation=problem.dilation, silu=problem.silu, positions=positions, channels=channels,
        front=round_up(problem.state_len, positions),
    )


def _extended(operands: dict, problem, s: Static):
    """``(x, ids, w, bias)`` laid out for the kernels: x ``[B, F + Lt + F, Dp]`` (the state
    before the sequence, zeros elsewhere), ids ``[B, F + Lt + F]`` int32, w ``[W, Dp]`` and bias
    ``[Dp]`` float32 (zeros without one)."""
    x = operands["x"]
    batch, length, dim = x.shape
    state_len, front = problem.state_len, s.front
    padded = round_up(length, s.positions)
    dim_p = round_up(dim, s.channels)
    ids = operands.get("ids")
    ids = jnp.zeros((batch, length), jnp.int32) if ids is None else ids.astype(jnp.int32)
    state = operands.get("state")
    past = jnp.zeros((batch, state_len, dim), x.dtype) if state is None else state.astype(x.dtype)
    # The state belongs to its row's first document; without one nothing is read there.
    past_ids = jnp.broadcast_to(ids[:, :1] if state is not None else jnp.int32(_NOTHING), (batch, state_len))
    after = padded - length + front
    xe = jnp.concatenate([past, x], axis=1)
    xe = jnp.pad(xe, ((0, 0), (front - state_len, after), (0, dim_p - dim)))
    ide = jnp.pad(jnp.concatenate([past_ids, ids], axis=1), ((0, 0), (front - state_len, after)),
                  constant_values=_NOTHING)
    w = jnp.pad(operands["w"].astype(jnp.float32), ((0, 0), (0, dim_p - dim)))
    bias = operands.get("bias")
    bias = jnp.zeros((dim_p,), jnp.float32) if bias is None else jnp.pad(bias.astype(jnp.float32), (0, dim_p - dim))
    return xe, ide, w, bias


def forward(operands: dict, *, problem, config: Config, interpret: bool):
    """``y (B, L, D)`` in x's dtype; ``operands``: ``x``, ``w`` and, where given, ``bias``,
    ``ids`` and ``state`` (as :func:`~..xla.forward`'s)."""
    x = operands["x"]
    batch, length, dim = x.shape
    s = _static(problem, config, backward=False)
    xe, ide, w, bias = _extended(operands, problem, s)
    tiles, dim_p = cdiv(length, s.positions), xe.shape[2]
    out = jax.ShapeDtypeStruct((batch, tiles * s.positions, dim_p), x.dtype)
    y = _launch(_forward_kernel, KERNELS[0], s, (batch, tiles, dim_p // s.channels), out, interpret)(xe, ide, w, bias)
    return y[:, :length, :dim]


def _sum_in_order(parts):
    """``parts.sum(0)`` added one part after another (a scan: the same bits run to run)."""
    total, _ = lax.scan(lambda acc, part: (acc + part, None), jnp.zeros_like(parts[0]), parts)
    return total


def backward(operands: dict, dy, *, problem, config: Config, interpret: bool):
    """The cotangents of x, the weight, the bias and the state (those given, in the
    operands' order), each rounded once to its operand's dtype."""
    x = operands["x"]
    batch, length, dim = x.shape
    s = _static(problem, config, backward=True)
    xe, ide, w, bias = _extended(operands, problem, s)
    tiles, dim_p, blocks = cdiv(length, s.positions), xe.shape[2], xe.shape[2] // s.channels
    padded, front = tiles * s.positions, s.front
    dy = jnp.pad(dy.astype(x.dtype), ((0, 0), (0, padded - length), (0, dim_p - dim)))
    g = _launch(_pre_grad_kernel, KERNELS[1], s, (batch, tiles, blocks),
                jax.ShapeDtypeStruct((batch, padded, dim_p), jnp.float32), interpret)(xe, ide, w, bias, dy)
    g = jnp.pad(g, ((0, 0), (front, front), (0, 0)))  # on the extended axis: no output there
    dx_tiles = (front + padded) // s.positions
    out = (
        jax.ShapeDtypeStruct((batch, front + padded, dim_p), x.dtype),
        jax.ShapeDtypeStruct((batch, dx_tiles, s.width, dim_p), jnp.float32),
        jax.ShapeDtypeStruct((batch, dx_tiles, dim_p), jnp.float32),
    )
    dxe, dw_parts, db_parts = _launch(_backward_kernel, KERNELS[2], s, (batch, dx_tiles, blocks), out, interpret)(
        xe, ide, w, g)
    grads = {
        "x": dxe[:, front:front + length, :dim],
        "w": _sum_in_order(dw_parts.reshape(-1, s.width, dim_p))[:, :dim].astype(operands["w"].dtype),
    }
    if "bias" in operands:
        grads["bias"] = _sum_in_order(db_parts.reshape(-1, dim_p))[:dim].astype(operands["bias"].dtype)
    if "state" in operands:
        grads["state"] = dxe[:, front - problem.state_len:front, :dim].astype(operands["state"].dtype)
    return [grads[name] for name in operands if name != "ids"]

