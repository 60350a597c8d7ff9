"""Bad inputs fuzzed: a valid random problem of one op, perturbed in exactly one way, must be refused by name.

The op: ``masked_conv``, ``causal_conv1d``, ``causal_conv1d_update``, ``causal_conv`` or
``causal_conv_stream``; the perturbation one of the op's list (wrong rank, channel
mismatch, integer or bool dtypes, zero, negative or fractional strides and dilations,
unknown padding strings and wrong pair counts, mask and segment_ids shapes, state shape,
dtype and type, slots out of range or repeated, unknown implementation or activation,
...). The call must raise ``ValueError`` or ``TypeError`` whose message starts with the
op's name (``"causal_conv1d: ..."``, or the registry's ``'causal_conv(implementation="triton") ...'``), or ``NotImplementedError`` where an implementation
named explicitly does not take the problem; it must not raise anything else, hang (each
call runs under a time limit) or return. The failures it found are explicit cases in
:mod:`.regressions`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.numerics import random

import maskconv_kernels as mk

from . import regressions
from .common import long_settings, time_limit

LIMIT_S = 120  # a first compile takes seconds; a hang, forever


# --------------------------------------------------------------------------- valid problems


def _masked_conv(rng):
    ndim = int(rng.integers(1, 3))
    c_in, c_out = 2 * int(rng.integers(1, 3)), 2 * int(rng.integers(1, 3))
    window = tuple(int(rng.integers(1, 4)) for _ in range(ndim))
    x = random(int(rng.integers(0, 999)), (int(rng.integers(1, 3)), *(int(rng.integers(6, 10)) for _ in range(ndim)), c_in))
    k = random(int(rng.integers(0, 999)), (*window, c_in, c_out))
    return dict(x=x, kernel=k, mask=np.ones(window, bool))


def _causal_conv1d(rng):
    b, l, d, w = int(rng.integers(1, 3)), int(rng.integers(2, 9)), int(rng.integers(2, 6)), int(rng.integers(2, 5))
    dilation = int(rng.integers(1, 3))
    return dict(x=random(1, (b, l, d)), weight=random(2, (w, d)), bias=random(3, (d,)),
                initial_state=random(4, (b, (w - 1) * dilation, d)), segment_ids=np.zeros((b, l), np.int32),
                dilation=dilation, activation="silu")


def _causal_conv1d_update(rng):
    b, d, w = int(rng.integers(1, 3)), int(rng.integers(2, 6)), int(rng.integers(2, 5))
    slots = b + int(rng.integers(1, 3))
    tokens = int(rng.integers(0, 3))
    return dict(x=random(1, (b, d) if tokens == 0 else (b, tokens, d)), conv_state=random(2, (slots, w - 1, d)),
                weight=random(3, (w, d)), state_indices=np.arange(b, dtype=np.int32))


def _causal_conv(rng):
    rank = int(rng.integers(3, 6))
    c = 2 * int(rng.integers(1, 3))
    x = random(1, (int(rng.integers(1, 3)), int(rng.integers(2, 8)), *(5,) * (rank - 3), c))
    k = random(2, (int(rng.integers(1, 4)), *(3,) * (rank - 3), c, 3))
    return dict(x=x, kernel=k, bias=random(3, (3,)), strides=1, dilation=1, padding="SAME")


def _causal_conv_stream(rng):
    args = _causal_conv(rng)
    s = 2  # a time stride: a later chunk must be a multiple of it
    first = 1 + int(rng.integers(0, 2))
    x = args.pop("x")
    x = jnp.concatenate([x, x, x, x], axis=1)  # room for a second chunk
    _, state = mk.causal_conv_stream(x[:, :first], None, args["kernel"], args["bias"], strides=s)
    return args | dict(x=x[:, first:first + 2 * s], state=state, strides=s)  # x: the chunk


def _call(op, args):
    args = dict(args)
    if op == "masked_conv":
        return mk.masked_conv(args.pop("x"), args.pop("kernel"), args.pop("mask"), **args)
    if op == "causal_conv1d":
        return mk.causal_conv1d(args.pop("x"), args.pop("weight"), args.pop("bias", None), **args)
    if op == "causal_conv1d_update":
        return mk.causal_conv1d_update(args.pop("x"), args.pop("conv_state"), args.pop("weight"), **args)
    if op == "causal_conv":
        return mk.causal_conv(args.pop("x"), args.pop("kernel"), args.pop("bias", None), **args)
    if op == "causal_conv_stream":
        return mk.causal_conv_stream(args.pop("x"), args.pop("state"), args.pop("kernel"), args.pop("bias", None),
                                     **args)
    raise AssertionError(op)


VALID = {
    "masked_conv": _masked_conv, "causal_conv1d": _causal_conv1d, "causal_conv1d_update": _causal_conv1d_update,
    "causal_conv": _causal_conv, "causal_conv_stream": _causal_conv_stream,
}


# --------------------------------------------------------------------------- perturbations: one change each


def _set(**changes):
    return lambda a, rng: a | changes


def _map(name, fn):
    return lambda a, rng: a | {name: fn(a[name], rng)}


def _ints(a, rng):
    return np.asarray(a).astype(np.int32)


def _bools(a, rng):
    return np.asarray(a) > 0


def _extra_channel(a, rng):
    return jnp.concatenate([a, a[..., :1]], axis=-1)


def _spatial_ones(a):
    return a["x"].ndim - 2


def _spatial(a):
    """A causal_conv case with at least one axis besides time (a 1-D layer takes padding="CAUSAL")."""
    if a["x"].ndim > 3:
        return a
    return a | dict(x=jnp.repeat(a["x"][:, :, None], 5, axis=2), kernel=jnp.repeat(a["kernel"][:, None], 3, axis=1))


COMMON = {  # every op's
    "x int": _map("x", _ints), "x bool": _map("x", _bools), "x rank+1": _map("x", lambda a, r: a[None]),
    "x rank-1": _map("x", lambda a, r: a[0]), "x None": _set(x=None), "x string": _set(x="abc"),
    "x ragged list": _set(x=[[1.0, 2.0], [3.0]]), "implementation unknown": _set(implementation="cudnn"),
    "implementation empty": _set(implementation=""), "interpret string": _set(interpret="yes"),
    "interpret int": _set(interpret=1),
}

PERTURBATIONS = {
    "masked_conv": COMMON | {
        "kernel channels": _map("kernel", lambda k, r: jnp.concatenate([k, k[..., :1, :]], axis=-2)),
        "kernel rank": _map("kernel", lambda k, r: k[None]), "kernel int": _map("kernel", _ints),
        "mask shape": _map("mask", lambda m, r: np.ones(tuple(n + 1 for n in m.shape), bool)),
        "mask values": _map("mask", lambda m, r: np.full(m.shape, 0.5)),
        "mask strings": _map("mask", lambda m, r: np.full(m.shape, "a")),
        "strides zero": _set(strides=0), "strides negative": _set(strides=-1), "strides float": _set(strides=1.5),
        "strides bool": _set(strides=True), "strides too many": lambda a, r: a | dict(strides=(1,) * (_spatial_ones(a) + 1)),
        "dilation zero": _set(dilation=0), "dilation negative": _set(dilation=-2),
        "padding unknown": _set(padding="FULL"), "padding pairs count": lambda a, r: a | dict(
            padding=((1, 1),) * (_spatial_ones(a) + 1)), "padding float pair": lambda a, r: a | dict(
            padding=((1.5, 1),) * _spatial_ones(a)), "padding crops all": lambda a, r: a | dict(
            padding=((-20, 0),) * _spatial_ones(a)),
        "groups zero": _set(feature_group_count=0), "groups not dividing": _set(feature_group_count=3),
        "segment_ids shape": lambda a, r: a | dict(segment_ids=np.zeros((1,) + a["x"].shape[1:-1], np.int32)[..., :-1]),
        "segment_ids float": lambda a, r: a | dict(segment_ids=np.zeros(a["x"].shape[:-1], np.float32)),
        "segment_ids strided": lambda a, r: a | dict(segment_ids=np.zeros(a["x"].shape[:-1], np.int32), strides=2),
        "preferred_element_type int": _set(preferred_element_type=jnp.int32), "precision bogus": _set(precision="bogus"),
        "config without implementation": _set(config=object()), "lhs_dilation zero": _set(lhs_dilation=0),
        "batch_group_count zero": _set(batch_group_count=0),
        "both stride spellings": _set(strides=1, window_strides=1),
    },
    "causal_conv1d": COMMON | {
        "weight channels": _map("weight", lambda w, r: jnp.concatenate([w, w[:, :1]], axis=1)),
        "weight transposed": _map("weight", lambda w, r: w.T if w.shape[0] != w.shape[1] else w[:, :-1]),
        "weight rank": _map("weight", lambda w, r: w[None]), "weight empty": _map("weight", lambda w, r: w[:0]),
        "weight int": _map("weight", _ints), "bias shape": _map("bias", _extra_channel), "bias int": _map("bias", _ints),
        "dilation zero": _set(dilation=0), "dilation negative": _set(dilation=-1), "dilation float": _set(dilation=1.5),
        "dilation string": _set(dilation="2"), "activation unknown": _set(activation="gelu"),
        "activation callable": _set(activation=jnp.tanh),
        "segment_ids shape": _map("segment_ids", lambda s, r: s[:, :-1]), "segment_ids float": _map(
            "segment_ids", lambda s, r: s.astype(np.float32)),
        "segment_ids and positions": lambda a, r: a | dict(positions=np.zeros_like(a["segment_ids"])),
        "positions float": lambda a, r: {k: v for k, v in a.items() if k != "segment_ids"} | dict(
            positions=np.zeros(a["segment_ids"].shape, np.float32)),
        "initial_state length": _map("initial_state", lambda s, r: jnp.concatenate([s, s[:, :1]], axis=1)),
        "initial_state batch": _map("initial_state", lambda s, r: jnp.concatenate([s, s], axis=0)),
        "initial_state dtype": _map("initial_state", lambda s, r: s.astype(jnp.float16)),
        "initial_state rank": _map("initial_state", lambda s, r: s[0]),
        "config without implementation": _set(config=object()),
    },
    "causal_conv1d_update": COMMON | {
        "weight channels": _map("weight", lambda w, r: jnp.concatenate([w, w[:, :1]], axis=1)),
        "bias shape": lambda a, r: a | dict(bias=jnp.ones(a["weight"].shape[1] + 1)),
        "pool dtype": _map("conv_state", lambda s, r: s.astype(jnp.bfloat16)),
        "pool short": _map("conv_state", lambda s, r: s[:, :-1]),
        "pool channels": _map("conv_state", _extra_channel), "pool rank": _map("conv_state", lambda s, r: s[0]),
        "indices float": _map("state_indices", lambda s, r: s.astype(np.float32)),
        "indices unsigned": _map("state_indices", lambda s, r: s.astype(np.uint32)),
        "indices past the pool": lambda a, r: a | dict(state_indices=np.full_like(a["state_indices"], a["conv_state"].shape[0])),
        "indices below -1": lambda a, r: a | dict(state_indices=np.full_like(a["state_indices"], -2)),
        "indices repeated": lambda a, r: a | dict(state_indices=np.zeros(2, np.int32), x=jnp.concatenate(
            [a["x"][:1], a["x"][:1]], axis=0)),
        "indices shape": _map("state_indices", lambda s, r: s[None]),
        "no indices, pool not B": lambda a, r: a | dict(state_indices=None),
        "cache_seqlens negative": lambda a, r: a | dict(cache_seqlens=np.full(a["x"].shape[0], -1, np.int32)),
        "cache_seqlens float": lambda a, r: a | dict(cache_seqlens=np.zeros(a["x"].shape[0], np.float32)),
        "has_initial_state int": lambda a, r: a | dict(has_initial_state=np.ones(a["x"].shape[0], np.int32)),
        "has_initial_state shape": lambda a, r: a | dict(has_initial_state=np.ones(a["x"].shape[0] + 1, bool)),
        "activation unknown": _set(activation="relu"), "dilation zero": _set(dilation=0),
    },
    "causal_conv": COMMON | {
        "kernel channels": _map("kernel", lambda k, r: jnp.concatenate([k, k[..., :1, :]], axis=-2)),
        "kernel rank": _map("kernel", lambda k, r: k[None]), "kernel int": _map("kernel", _ints),
        "bias shape": _map("bias", _extra_channel), "x no frames": _map("x", lambda x, r: x[:, :0]),
        "strides zero": _set(strides=0), "strides negative": _set(strides=-1), "strides float": _set(strides=1.5),
        "strides too many": lambda a, r: a | dict(strides=(1,) * (_spatial_ones(a) + 1)),
        "dilation zero": _set(dilation=0), "padding unknown": _set(padding="FULL"),
        "padding causal, spatial": lambda a, r: _spatial(a) | dict(padding="CAUSAL"),
        "padding pairs count": lambda a, r: a | dict(padding=((1, 1),) * _spatial_ones(a)),
        "padding_mode reflect": _set(padding_mode="reflect"), "padding_mode unknown": _set(padding_mode="edge"),
        "groups zero": _set(feature_group_count=0), "groups not dividing": _set(feature_group_count=3),
        "segment_ids shape": lambda a, r: a | dict(segment_ids=np.zeros(a["x"].shape[:-2], np.int32)),
        "segment_ids float": lambda a, r: a | dict(segment_ids=np.zeros(a["x"].shape[:-1], np.float32)),
        "segment_ids strided": lambda a, r: a | dict(segment_ids=np.zeros(a["x"].shape[:-1], np.int32), strides=2),
        "segment_ids replicate": lambda a, r: a | dict(segment_ids=np.zeros(a["x"].shape[:-1], np.int32),
                                                       padding_mode="replicate"),
        "dimension_numbers bogus": _set(dimension_numbers="NCHW"), "precision bogus": _set(precision="bogus"),
        "config without implementation": _set(config=object()),
        "kernel backend, groups": lambda a, r: a | dict(implementation="pallas_triton", interpret=True,
                                                        feature_group_count=2),
    },
    "causal_conv_stream": COMMON | {
        "state a dict": lambda a, r: a | dict(state={"frames": a["state"].frames}),
        "state a tuple": lambda a, r: a | dict(state=tuple(a["state"].frames.shape)),
        "state of another kernel": lambda a, r: a | dict(kernel=jnp.concatenate([a["kernel"], a["kernel"][:1]], axis=0)),
        "state of another batch": lambda a, r: a | dict(x=jnp.concatenate([a["x"]] * 2, axis=0)),
        "state of another dtype": lambda a, r: a | dict(x=a["x"].astype(jnp.bfloat16),
                                                        kernel=a["kernel"].astype(jnp.bfloat16),
                                                        bias=a["bias"].astype(jnp.bfloat16)),
        "chunk off stride": lambda a, r: a | dict(x=a["x"][:, :1]),
        "chunk empty": _map("x", lambda x, r: x[:, :0]),
        "segment_ids mid-stream": lambda a, r: a | dict(segment_ids=np.zeros(a["x"].shape[:-1], np.int32)),
        "padding_mode unknown": _set(padding_mode="edge"), "dilation zero": _set(dilation=0),
    },
}
# Ops whose messages need not start with their name: none since masked_conv's got it.
UNPREFIXED: set[str] = set()


def check_invalid(op, seed, perturbation, require_prefix=None):
    """The perturbed call raises a named ValueError or TypeError, or NotImplementedError; nothing else, within the limit.

    ``require_prefix``: whether the message must start with ``"<op>: "`` (default: every op
    but those of :data:`UNPREFIXED`)."""
    if require_prefix is None:
        require_prefix = op not in UNPREFIXED
    rng = np.random.default_rng(seed)
    args = PERTURBATIONS[op][perturbation](VALID[op](rng), rng)
    try:
        with time_limit(LIMIT_S):
            _call(op, args)
    except NotImplementedError as e:
        assert "implementation" in str(e), f"{op}, {perturbation}: NotImplementedError that names no implementation: {e}"
        return
    except (ValueError, TypeError) as e:
        message = str(e)
        if require_prefix:
            # "causal_conv: ..." or the registry's 'causal_conv(implementation="xla") takes ...'
            assert message.startswith((f"{op}: ", f"{op}(")), f"{op}, {perturbation}: {type(e).__name__} not in the op's words: {e!r}"
        return
    except Exception as e:  # noqa: BLE001  anything else is a crash
        raise AssertionError(f"{op}, {perturbation}: crashed with {type(e).__name__}: {e}") from e
    raise AssertionError(f"{op}, {perturbation}: accepted silently")


@st.composite
def invalid_problems(draw):
    op = draw(st.sampled_from(sorted(PERTURBATIONS)))
    perturbation = draw(st.sampled_from([p for p in sorted(PERTURBATIONS[op]) if (op, p) not in regressions.KNOWN_INVALID]))
    return op, draw(st.integers(0, 2**16)), perturbation


@given(problem=invalid_problems())
def test_fuzz_invalid_inputs_raise_named_errors(problem):
    check_invalid(*problem)


@pytest.mark.slow
@long_settings(4)
@given(problem=invalid_problems())
def test_fuzz_invalid_inputs_long_profile(problem):
    check_invalid(*problem)


# Every perturbation once (the fuzzer draws among them; these make sure each is tried).
# (The known failures run in test_fuzz_invalid_regressions, as strict xfails.)
@pytest.mark.parametrize("op, perturbation", [(op, p) for op in sorted(PERTURBATIONS) for p in sorted(PERTURBATIONS[op])
                                              if (op, p) not in regressions.KNOWN_INVALID])
def test_each_perturbation_once(op, perturbation):
    check_invalid(op, 0, perturbation)


@pytest.mark.parametrize("case", regressions.param_list(regressions.INVALID))
def test_fuzz_invalid_regressions(case):
    case.run(check_invalid)
