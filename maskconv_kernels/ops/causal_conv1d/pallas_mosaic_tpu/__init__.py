"""``causal_conv1d``'s ``pallas_mosaic_tpu`` implementation: Pallas kernels lowered through Mosaic for TPUs.

* :mod:`.config`: :class:`Config`, the blocks and the VMEM limit;
* :mod:`.kernels`: the forward and the backward kernel (VPU code: a depthwise conv has
  no matmul), each block with its halo rows read as a second BlockSpec;
* :mod:`.decode`: ``causal_conv1d_update``'s decode step as one launch (:func:`update`):
  the rows' slots read and written by DMA in a pool left in HBM and aliased in place;
* :mod:`.mixed`: ``causal_conv1d_step``'s step of prefill chunks and decode tokens as one
  launch (:func:`step`), the pool as the decode kernel keeps it.

Lowers for TPUs, or runs anywhere in Pallas' interpreter (``interpret=True``, traced
inline). Every feature of the op: segment ids (and positions, read as ids), an initial
state and its gradient, any width and dilation, bias, SiLU, float32 and bfloat16 inputs
(float32 arithmetic, weights of any float dtype). float16 is refused: TPUs have no
float16 arithmetic (``implementation="xla"`` converts it). The op's primitives
(:class:`~maskconv_kernels._core.fused.FusedOp`) lower :func:`forward` and
:func:`backward`, and give them derivatives of every order. ``implementation=None`` on a
TPU takes them for sequences of at least :data:`PREFERRED_FROM` positions
(:func:`not_preferred`).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..checks import Problem
from .config import KERNELS, Config, halo_rows

__all__ = [
    "Config", "KERNELS", "DTYPES", "PREFERRED_FROM", "MAX_DECODE_TOKENS", "unsupported", "not_preferred", "forward",
    "backward", "update", "step",
]

DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))
# implementation=None takes the kernels for sequences of at least one forward block: they
# were timed at 2k-16k positions (docs/performance.md, TPU v5e). Shorter calls (the
# serving step's small chunks) keep xla's path; causal_conv1d_update's decode step has its
# own kernel (update, .decode), timed against xla's there.
PREFERRED_FROM = Config().block_positions
# The decode kernel unrolls its tokens: more than this per row is a prefill chunk, which
# the forward kernel (or xla) runs.
MAX_DECODE_TOKENS = 16
_WEIGHT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def unsupported(problem: Problem, platform: str | None, interpret: bool = False) -> str | None:
    """Why the Mosaic TPU kernels cannot run ``problem`` (``None`` when they can); the
    record says they lower for TPUs (or anywhere interpreted)."""
    if problem.x_dtype not in DTYPES:
        return (f"x in {problem.x_dtype}: its kernels take float32 and bfloat16 (TPUs have no float16 arithmetic; "
                "implementation='xla' takes it)")
    for name, dtype in problem.dtypes.items():
        if np.dtype(dtype) not in _WEIGHT_DTYPES:
            return f"{name} in {dtype}: its kernels take float32, bfloat16 and float16 (implementation='xla' takes it)"
    return None


def not_preferred(problem: Problem, platform: str) -> str | None:
    """Why ``implementation=None`` passes over the kernels for ``problem`` on ``platform``:
    sequences shorter than :data:`PREFERRED_FROM` positions."""
    if problem.length < PREFERRED_FROM:
        return (f"{problem.length} positions: implementation=None takes the kernels from {PREFERRED_FROM} on (the "
                "lengths they were timed at); name them to run them on shorter sequences")
    return None


def forward(operands: dict, *, problem: Problem, config: Config | None = None, interpret: bool = False):
    """``y (B, L, D)`` in x's dtype from the forward kernel (float32 arithmetic, bias and SiLU
    in float32, rounded once); ``operands`` as :func:`~..xla.forward`'s."""
    from . import kernels  # Pallas: imported when this implementation lowers

    s, args = _laid_out(operands, problem, config, backward=False)
    y = kernels.forward(*args, s=s, interpret=bool(interpret))
    return y[:, :problem.length]


def backward(operands: dict, dy, *, problem: Problem, config: Config | None = None, interpret: bool = False):
    """The cotangents of x, the weight, the bias and the state (those given, in the
    operands' order) from the backward kernel, each rounded once to its operand's dtype."""
    from . import kernels

    s, args = _laid_out(operands, problem, config, backward=True)
    x = operands["x"]
    length = problem.length
    dy = _rows(dy.astype(x.dtype), args[0].shape[1])
    dx, dw, db, dfront = kernels.backward(*args, dy, s=s, interpret=bool(interpret))
    grads = {"x": dx[:, :length], "w": dw.sum(0).astype(operands["w"].dtype)}
    if "bias" in operands:
        grads["bias"] = db.sum((0, 1)).astype(operands["bias"].dtype)
    if "state" in operands:
        grads["state"] = dfront[:, s.halo - problem.state_len:].astype(operands["state"].dtype)
    return [grads[name] for name in operands if name != "ids"]


def update(x, pool, weight, bias, reads, writes, *, problem: Problem, config: Config | None = None,
           interpret: bool = False):
    """``(y (B, T, D), pool)`` from the decode kernel: ``x (B, T, D)`` after each row's slot
    of ``pool (slots, state_len, D)`` (x's dtype); ``reads``, ``writes`` ``(B,)`` int32 codes
    (:mod:`.decode`); the pool returned is the one given, aliased (in place when donated)."""
    from . import decode

    config = config if config is not None else Config()
    batch, _, dim = x.shape
    rows, channels = config.decode_blocks(batch, dim)
    s = decode.DecodeStatic(problem=problem, state_len=pool.shape[1], rows=rows, channels=channels)
    b = bias.astype(jnp.float32)[None] if bias is not None else None
    return decode.update(x, pool, weight.astype(jnp.float32), b, reads, writes, s=s, interpret=bool(interpret))


def step(x, pool, weight, bias, qsl, reads, writes, owner, within, *, problem: Problem, config: Config | None = None,
         interpret: bool = False, blocks=None, shifts=None, limits=None):
    """``(y (T, D), pool)`` from the mixed step's kernel: ``x (T, D)``, requests' tokens back
    to back as ``qsl (R + 1,)`` says; ``reads``, ``writes`` ``(R,)`` int32 codes (:mod:`.decode`'s);
    ``owner``, ``within`` ``(T,)`` int32, each token's request (``R`` for padding) and index
    in it; ``blocks``: prefix caching's ``(K, targets (R, M) int32 slots or -1, computed (R,)
    int32)`` or ``None`` (:func:`.mixed.state_events`); ``shifts (R,)`` int32 or ``None``:
    how many rows before a slot's last its history ends (speculative decoding, the rows
    after it rejected drafts); ``limits (T,)`` int32 or ``None``: how far back each token
    may read, to its request's last document start (``positions``); the pool returned is
    the one given, aliased."""
    from . import mixed

    config = config if config is not None else Config()
    tokens, dim = x.shape
    tile, channels = config.step_blocks(tokens, dim)
    s = mixed.MixedStatic(problem=problem, state_len=pool.shape[1], tile=tile, channels=channels,
                          states_from_frame=config.step_states_from_frame, shifted=shifts is not None,
                          positioned=limits is not None)
    s = s.fitted(x.dtype.itemsize, pool.dtype.itemsize)
    b = bias.astype(jnp.float32)[None] if bias is not None else None
    return mixed.step(x, pool, weight.astype(jnp.float32), b, qsl, reads, writes, owner, within, s=s,
                      interpret=bool(interpret), blocks=blocks, shifts=shifts, limits=limits)


def _rows(a, rows: int, fill=0):
    """``a [B, L, ...]`` with ``rows`` positions: padded after its end where it has fewer."""
    extra = rows - a.shape[1]
    if extra <= 0:
        return a
    return jnp.pad(a, ((0, 0), (0, extra)) + ((0, 0),) * (a.ndim - 2), constant_values=fill)


def _laid_out(operands: dict, problem: Problem, config: Config | None, backward: bool):
    """``(Static, (x, front, w, bias, ids, ids_front))`` as :mod:`.kernels` lays them out.

    x has at least one block of positions (a shorter sequence is padded to one: the
    only copy made); the front holds the state in its last ``S`` rows, zeros before;
    the ids (``[B, L, 1]`` int32) are ``-1`` past the end, and the front's are the row's
    first document's where a state is (it belongs to that document), ``-1`` elsewhere.
    """
    from .kernels import Static

    config = config if config is not None else Config.get_default(problem.length, problem.dim)
    halo, state_len = halo_rows(problem.state_len), problem.state_len
    positions, channels = config.blocks(backward, problem.length, problem.dim, state_len)
    s = Static(problem=problem, positions=positions, channels=channels, halo=halo)
    x = operands["x"]
    batch, _, dim = x.shape
    rows = max(problem.length, positions)
    state = operands.get("state")
    past = jnp.zeros((batch, 0, dim), x.dtype) if state is None else state.astype(x.dtype)
    front = jnp.pad(past, ((0, 0), (halo - past.shape[1], 0), (0, 0)))
    w = operands["w"].astype(jnp.float32)
    bias = operands["bias"].astype(jnp.float32)[None] if "bias" in operands else None
    ids = ids_front = None
    if problem.segmented:
        ids = operands["ids"].astype(jnp.int32)
        first = ids[:, :1] if state is not None else jnp.full((batch, 1), -1, jnp.int32)
        ids_front = jnp.where(jnp.arange(halo) >= halo - past.shape[1], first, -1)[..., None]
        ids = _rows(ids[..., None], rows, fill=-1)
    return s, (_rows(x, rows), front, w, bias, ids, ids_front)
