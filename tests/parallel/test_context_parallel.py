"""Context parallelism: sequence-sharded ``causal_conv1d`` and segment ids through spatial sharding.

:func:`parallel.sequence_sharded_causal_conv1d` against ``causal_conv1d`` on one device,
and :func:`parallel.spatially_sharded_masked_conv` with ``segment_ids`` against
``masked_conv``, with packed documents that straddle the shard borders. The checks need
8 devices: in an ordinary run, ``test_on_8_forced_cpu_devices`` runs this file in a fresh
interpreter with 8 forced CPU devices (``conftest.run_on_forced_cpu_devices``).

What is equal bit for bit: the outputs and the final states of ``causal_conv1d``, and
the outputs of depthwise masks (compared as bits, signs of zero included). Each output is
the same selects, products and sum as on one device, on the same inputs (the halo is a
copy), in a program of the same structure; the final state is a copy. Other masks with
segment ids are im2col GEMMs, whose blocking (and so the order of their sums) may
depend on the number of rows a device holds: within the dtype's tolerance.

What is within the dtype's tolerance instead: every gradient. The input gradient of the
last ``(W - 1) * dilation`` positions before each border adds its taps' contributions
from two shards (in 16-bit x, each shard's partial sum is rounded before the two are
added); the weight and bias gradients are one reduction over ``B * L`` positions on one
device and a ``psum`` of per-shard sums here. Even where the terms are the same and in
the same order, XLA's CPU compiler contracts ``a * b + c`` into fused multiply-adds
wherever its fusions allow, and the backward programs fuse differently around the halo
exchange: one-ulp differences appear away from the borders too (measured: 1 element of
460 in one case).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.mesh import N_DEVICES, has_mesh_already, needs_mesh, run_on_forced_cpu_devices
from support.numerics import assert_close, random
from support.tiers import tiered
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import maskconv_kernels as mk
from maskconv_kernels import parallel
from maskconv_kernels.ops.causal_conv1d import causal_conv1d

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)
SILU_SLOPE = 1.1  # max |silu'(z)| = 1.0998: a cotangent through SiLU grows by at most this


@has_mesh_already
def test_on_8_forced_cpu_devices():
    run_on_forced_cpu_devices(__file__)


def _mesh(shape, names, axis_type):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))


def assert_bits_equal(actual, expected, what):
    assert np.asarray(actual).dtype == np.asarray(expected).dtype, what
    np.testing.assert_array_equal(_bits(actual), _bits(expected), err_msg=what)


# Four sequence shards of 8 positions, two batch shards of 2 rows (L = 32).
SHARDS, LOCAL, BATCH, DIM = 4, 8, 4, 5


def _runs(*runs) -> np.ndarray:
    """A row of ids from ``(id, count)`` runs."""
    return np.concatenate([np.full(n, i, np.int32) for i, n in runs])


PACKED = np.stack([
    # Documents straddling the borders at 8 and 16; trailing padding covers shard 3 and
    # most of shard 2, so the final state comes from shard 2 and its halo.
    _runs((0, 5), (1, 9), (2, 4), (-1, 14)),
    # A document across three borders; the last one (5 positions) is shorter than a
    # (W - 1) * dilation = 6 state.
    _runs((3, 7), (4, 20), (5, 5)),
    # All padding: zero outputs and a zero final state.
    _runs((-1, 32)),
    # Leading padding, one-position documents, a document that starts on a border.
    _runs((-1, 3), (0, 1), (1, 1), (2, 19), (3, 8)),
])

# width, dilation, bias, activation, x dtype, weight dtype, segments, initial state
CASES = [
    (4, 1, True, "silu", F32, F32, True, True),
    (4, 2, True, "silu", F32, F32, True, False),
    (2, 1, False, None, F32, F32, True, True),
    (2, 2, True, None, F32, F32, False, True),
    (4, 2, False, "silu", F32, F32, False, False),
    (4, 1, True, "silu", BF16, F32, True, True),  # Mamba's default: 16-bit activations, float32 weights
    (2, 2, True, "silu", BF16, BF16, True, False),
    (1, 1, True, "silu", F32, F32, True, False),  # no halo at all
]


def _case_id(case):
    w, dil, bias, act, xd, wd, seg, st = case
    return f"W{w}_d{dil}{'_bias' if bias else ''}{'_silu' if act else ''}_{xd}-{wd}{'_seg' if seg else ''}{'_state' if st else ''}"


def _inputs(seed, width, dilation, x_dtype, w_dtype, length=SHARDS * LOCAL, batch=BATCH):
    x = np.array(random(seed, (batch, length, DIM), x_dtype))
    # Signed zeros, among them in row 1's final state: they must arrive as they are.
    x[:, ::7, 0] = -0.0
    x[:, 3::7, 1] = 0.0
    w = random(seed + 1, (width, DIM), w_dtype, scale=0.5)
    b = random(seed + 2, (DIM,), w_dtype, scale=0.5)
    state = random(seed + 3, (batch, (width - 1) * dilation, DIM), x_dtype)
    return jnp.asarray(x), w, b, state


# Zigzagged, 2 * SHARDS chunks of 8: the rows of PACKED again, documents renumbered.
PACKED_TWICE = np.concatenate([PACKED, np.where(PACKED >= 0, PACKED + 10, PACKED)], axis=1)
FAST = (CASES[1], CASES[5], CASES[-1])
LAYOUT_CASES = [(c, "contiguous") for c in CASES] + [(c, "zigzag") for c in CASES]


def _layout_case_id(case_layout):
    case, layout = case_layout
    return f"{layout}-{_case_id(case)}"


@needs_mesh
# The fast tier: zigzagged, the default (width 4, bias, SiLU, segments, a state) in
# Mamba's mixed dtypes; contiguous, the dilated halo and no halo at all.
@pytest.mark.parametrize("case_layout", tiered(
    LAYOUT_CASES, lambda c: c[0] in (FAST[1:] if c[1] == "contiguous" else FAST[:1])), ids=_layout_case_id)
def test_sequence_sharded_equals_one_device(case_layout):
    """Outputs and final states bit for bit; in the zigzag layout, the inputs permuted by
    to_zigzag and the outputs (and gradients) back by from_zigzag, outside the function."""
    case, layout = case_layout
    width, dilation, bias, activation, x_dtype, w_dtype, segmented, stateful = case
    zigzag = layout == "zigzag"
    mesh = _mesh((SHARDS, 2), ("seq", "data"), AxisType.Explicit)
    x, w, b, state = _inputs(10, width, dilation, x_dtype, w_dtype, length=SHARDS * LOCAL * (2 if zigzag else 1))
    ids = jnp.asarray(PACKED_TWICE if zigzag else PACKED) if segmented else None
    kw = dict(return_final_state=True, activation=activation, dilation=dilation)
    # Permuted on the host, as a data loader lays out a batch.
    into = (lambda a: a) if not zigzag else (lambda a: None if a is None else parallel.to_zigzag(a, SHARDS))  # noqa: E731
    back = (lambda a: a) if not zigzag else (lambda a: parallel.from_zigzag(np.asarray(a), SHARDS))  # noqa: E731
    ids_in_layout = into(ids)

    def sharded(x, w, b, state):
        return parallel.sequence_sharded_causal_conv1d(
            x, w, b if bias else None, mesh=mesh, axis_name="seq", batch_axis="data", segment_ids=ids_in_layout,
            initial_state=state if stateful else None, layout=layout, **kw,
        )

    def single(x, w, b, state):
        return causal_conv1d(x, w, b if bias else None, initial_state=state if stateful else None, implementation="xla",
                             segment_ids=ids, **kw)

    (y, final), (y1, final1) = jax.jit(sharded)(into(x), w, b, state), jax.jit(single)(x, w, b, state)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "seq")), y.ndim), y.sharding
    assert final.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), final.ndim), final.sharding
    y = back(y)
    assert_bits_equal(y, y1, "y")
    assert_bits_equal(final, final1, "final state")
    assert np.isfinite(np.asarray(y, np.float64)).all()

    dy, dfinal = random(20, y.shape, x_dtype), random(21, final.shape, x_dtype)
    vjp = lambda f, ct: jax.jit(lambda *a: jax.vjp(f, *a)[1](ct))  # noqa: E731
    dx, dw, db, dstate = vjp(sharded, (into(dy), dfinal))(into(x), w, b, state)
    dx1, dw1, db1, dstate1 = vjp(single, (dy, dfinal))(x, w, b, state)
    dx = back(dx)

    # Each term of dx |w[t] * dy'| <= max|w| * max|dy| * SiLU's slope; width terms.
    slope = SILU_SLOPE if activation else 1.0
    w_max, dy_max = float(np.abs(np.asarray(w, np.float64)).max()), float(np.abs(np.asarray(dy, np.float64)).max())
    assert_close(dx, dx1, x_dtype, width, width * w_max * dy_max * slope)
    if stateful:
        assert_close(dstate, dstate1, x_dtype, width, width * w_max * dy_max * slope)
    x_max = float(np.abs(np.asarray(x, np.float64)).max())
    positions = x.shape[0] * x.shape[1]
    assert_close(dw, dw1, w_dtype, positions, x_max * dy_max * slope)
    assert_close(db, db1, w_dtype, positions, dy_max * slope)
    for got, like in zip((dx, dw, db, dstate), (x, w, b, state)):
        assert got.dtype == like.dtype


def _permute_pairs(text: str) -> set[tuple[int, int]]:
    pairs = set()
    for group in re.findall(r"source_target_pairs=\{(.*?)\}\}", text):
        pairs |= {(int(a), int(b)) for a, b in re.findall(r"(\d+),(\d+)", group)}
    return pairs


@needs_mesh
def test_jit_with_named_sharding_inputs_compiles_without_all_gather():
    # Auto axes, no mesh in context: the inputs' NamedShardings carry the split.
    mesh = _mesh((SHARDS, 2), ("seq", "data"), AxisType.Auto)
    x, w, b, state = _inputs(30, 4, 2, F32, F32)
    split = NamedSharding(mesh, P("data", "seq"))
    xs, ids = jax.device_put(x, split), jax.device_put(jnp.asarray(PACKED), split)
    state = jax.device_put(state, NamedSharding(mesh, P("data")))

    def conv(x, w, b, state):
        return parallel.sequence_sharded_causal_conv1d(
            x, w, b, mesh=mesh, axis_name="seq", batch_axis="data", segment_ids=ids, initial_state=state,
            return_final_state=True, activation="silu", dilation=2,
        )

    def loss(x, w, b, state):
        y, final = conv(x, w, b, state)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final**2)

    forward = jax.jit(conv).lower(xs, w, b, state).compile()
    gradients = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(xs, w, b, state).compile()
    y, _ = forward(xs, w, b, state)
    dx, dw, db, dstate = gradients(xs, w, b, state)
    assert y.sharding.is_equivalent_to(split, 3) and dx.sharding.is_equivalent_to(split, 3), (y.sharding, dx.sharding)
    assert dw.sharding.is_fully_replicated and db.sharding.is_fully_replicated
    for compiled in (forward, gradients):
        text = compiled.as_text()
        assert "all-gather" not in text, f"the compiled program gathers:\n{text}"
        assert "collective-permute" in text
        # No device ever holds a whole sequence: (2 rows, 8 positions, 5 channels) each.
        assert not re.search(rf"f32\[\d+,{SHARDS * LOCAL},{DIM}\]", text), f"a device holds a whole sequence:\n{text}"
    # The weight and bias gradients are summed over the mesh.
    assert "all-reduce" in gradients.as_text()

    # Forward mode too (the final state's copy has a linear tangent rule), as on one device.
    def single(x, w, b, state):
        return causal_conv1d(
            x, w, b, segment_ids=PACKED, initial_state=state, return_final_state=True, activation="silu", dilation=2,
            implementation="xla",
        )

    primals, tangents = (xs, w, b, state), (x / 2, w / 4, b, state / 3)
    (y, final), (ty, tfinal) = jax.jit(lambda *p: jax.jvp(conv, p, tangents))(*primals)
    (y1, final1), (ty1, tfinal1) = jax.jit(lambda *p: jax.jvp(single, p, tangents))(x, w, b, state)
    assert_bits_equal(y, y1, "y")
    assert_bits_equal(final, final1, "final state")
    np.testing.assert_array_equal(np.asarray(tfinal), np.asarray(tfinal1))  # copies of the tangents
    # A bound on the sum of |terms| of a tangent: width taps of x' w + x w', and b'.
    big = lambda *arrays: max(float(np.abs(np.asarray(a, np.float64)).max()) for a in arrays)  # noqa: E731
    terms = 4 * (big(x, state) * big(w) / 2 + big(x, state) * big(w) / 4) + big(b)
    assert_close(ty, ty1, F32, 4, SILU_SLOPE * terms)


@needs_mesh
def test_nan_in_later_shards_never_reaches_earlier_positions():
    # 8 shards of 6 positions, each exactly the (W - 1) * dilation = 6 halo the next needs.
    mesh = _mesh((N_DEVICES,), ("seq",), AxisType.Auto)
    length, width, dilation = N_DEVICES * 6, 4, 2
    x, w, b, state = _inputs(40, width, dilation, F32, F32, length=length, batch=2)
    ids = jnp.asarray(np.stack([_runs((0, 10), (1, 17), (-1, 4), (2, 17)), _runs((5, 47), (6, 1))]))

    # No activation: SiLU's derivative at a NaN is NaN, and a zero cotangent times it
    # would carry NaN back to the halo on one device as well.
    def conv(x, ids):
        return parallel.sequence_sharded_causal_conv1d(
            x, w, b, mesh=mesh, axis_name="seq", segment_ids=ids, initial_state=state, dilation=dilation
        )

    forward = jax.jit(conv)
    clean = np.asarray(forward(x, ids))
    assert np.isfinite(clean).all()

    # The loss on the positions before a border, the border a traced value (one compile).
    def loss(x, ids, border):
        before = jnp.arange(length)[None, :, None] < border
        return jnp.sum(jnp.where(before, conv(x, ids), 0.0) ** 2)

    grad_x = jax.jit(jax.grad(loss))
    for border in range(6, length, 6):
        poisoned = x.at[:, border:].set(jnp.nan)
        relabelled = ids.at[:, border:].set(ids[:, border:] + 100)
        y = np.asarray(forward(poisoned, relabelled))
        # Bit-identical before the border, in every shard (not only the one next to it).
        assert_bits_equal(y[:, :border], clean[:, :border], f"border at {border}")
        # Backward: exactly zero gradient from the border on, identical before it.
        dx, dx_clean = np.asarray(grad_x(poisoned, relabelled, border)), np.asarray(grad_x(x, ids, border))
        assert (dx[:, border:] == 0).all(), f"border at {border}"
        np.testing.assert_array_equal(dx[:, :border], dx_clean[:, :border], err_msg=f"border at {border}")
    # Causal: halos only travel to the next shard (device i to i + 1).
    pairs = _permute_pairs(forward.lower(x, ids).compile().as_text())
    assert pairs and all(b == a + 1 for a, b in pairs), pairs


def test_to_zigzag_gives_device_i_chunks_i_and_2s_minus_1_minus_i_and_from_zigzag_undoes_it():
    x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    z = np.asarray(parallel.to_zigzag(x, 2))  # 4 chunks of 4: 0, 3 | 1, 2
    np.testing.assert_array_equal(z[:, :, 0] // 3 % 16, np.tile(np.r_[0:4, 12:16, 4:8, 8:12], (2, 1)))
    np.testing.assert_array_equal(np.asarray(parallel.from_zigzag(z, 2)), x)
    np.testing.assert_array_equal(np.asarray(parallel.from_zigzag(parallel.to_zigzag(x, 4, axis=-2), 4, axis=-2)), x)
    with pytest.raises(ValueError, match="multiple of 2 \\* shards = 6"):
        parallel.to_zigzag(x, 3)


@needs_mesh
def test_zigzag_of_an_array_split_by_an_explicit_mesh_keeps_its_sharding():
    """jax.make_mesh's default axes are Explicit: the permutation names its output's sharding (the input's)."""
    mesh = _mesh((SHARDS, 2), ("seq", "data"), AxisType.Explicit)
    x = np.arange(2 * 64 * 3, dtype=np.float32).reshape(2, 64, 3)
    split = jax.device_put(x, NamedSharding(mesh, P("data", "seq")))
    for fn in (lambda a: parallel.to_zigzag(a, SHARDS), jax.jit(lambda a: parallel.from_zigzag(a, SHARDS))):
        y = fn(split)
        assert jax.typeof(y).sharding.spec == P("data", "seq", None)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(fn(x)))


@needs_mesh
def test_zigzag_exchanges_halos_by_permutes_alone_and_no_nan_crosses_to_earlier_chunks():
    """Every chunk's history comes by collective-permutes (no all-gather); NaN from a border on,
    in sequence order, changes no output before it, on any device."""
    mesh = _mesh((SHARDS,), ("seq",), AxisType.Auto)
    length, width, dilation = 2 * SHARDS * 6, 4, 2  # chunks of 6: each exactly the halo the next needs
    x, w, b, state = _inputs(60, width, dilation, F32, F32, length=length, batch=2)
    ids = jnp.asarray(np.stack([_runs((0, 10), (1, 17), (-1, 4), (2, 17)), _runs((5, 47), (6, 1))]))

    def conv(xz, idz):
        return parallel.sequence_sharded_causal_conv1d(
            xz, w, b, mesh=mesh, axis_name="seq", segment_ids=idz, initial_state=state, dilation=dilation,
            layout="zigzag", return_final_state=True,
        )

    forward = jax.jit(conv)
    text = forward.lower(parallel.to_zigzag(x, SHARDS), parallel.to_zigzag(ids, SHARDS)).compile().as_text()
    assert "collective-permute" in text and "all-gather" not in text
    clean, final = forward(parallel.to_zigzag(x, SHARDS), parallel.to_zigzag(ids, SHARDS))
    y1, final1 = causal_conv1d(x, w, b, segment_ids=ids, initial_state=state, dilation=dilation,
                               return_final_state=True, implementation="xla")
    clean = np.asarray(parallel.from_zigzag(np.asarray(clean), SHARDS))
    assert_bits_equal(clean, y1, "y")
    assert_bits_equal(final, final1, "final state")
    for border in range(6, length, 6):
        poisoned = x.at[:, border:].set(jnp.nan)
        relabelled = ids.at[:, border:].set(ids[:, border:] + 100)
        y, _ = forward(parallel.to_zigzag(poisoned, SHARDS), parallel.to_zigzag(relabelled, SHARDS))
        y = np.asarray(parallel.from_zigzag(np.asarray(y), SHARDS))
        assert_bits_equal(y[:, :border], clean[:, :border], f"border at {border}")


@needs_mesh
def test_sequence_sharding_limits_are_reported():
    mesh = _mesh((SHARDS, 2), ("seq", "data"), AxisType.Explicit)
    x, w, _, _ = _inputs(50, 4, 1, F32, F32)

    def call(x, w, axis_name="seq", **kw):
        return parallel.sequence_sharded_causal_conv1d(x, w, mesh=mesh, axis_name=axis_name, batch_axis="data", **kw)

    with pytest.raises(ValueError, match="multiple of the 4 shards"):
        call(x[:, :30], w)
    with pytest.raises(ValueError, match=r"halo of \(W - 1\) \* dilation = 9 .* use at most 2 shards"):
        # 8 positions per shard; width 4 at dilation 3 reaches back 9.
        call(x, w, dilation=3)
    with pytest.raises(ValueError, match="not an axis"):
        call(x, w, axis_name="rows")
    with pytest.raises(ValueError, match=r"multiple of the 4 shards along 'seq' times 2 \(the zigzag layout's 8 chunks\)"):
        call(x[:, :28], w, layout="zigzag")
    with pytest.raises(ValueError, match=r"each chunk holds 4 positions .* = 6 .*zigzag layout.*use at most 2 shards"):
        call(x, w, dilation=2, layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        call(x, w, layout="ring")
    with pytest.raises(ValueError, match="initial_state must be"):
        call(x, w, initial_state=jnp.zeros((BATCH, 2, DIM)))
    with pytest.raises(TypeError, match="segment_ids must hold integers"):
        call(x, w, segment_ids=jnp.zeros(x.shape[:2]))
    with pytest.raises(ValueError, match="activation must be"):
        call(x, w, activation="relu")


# --------------------------------------------------------------------------- images

SPATIAL = {
    # A causal 2-D mask: the halo (and its ids) from above only.
    "pixelcnnB_3x3": (mk.pixelcnn_mask((3, 3), "B"), (4, 16, 6, 3), {}),
    # Every tap: halos and ids from both sides, padding ids past the last shard.
    "full_3x3": (np.ones((3, 3), bool), (4, 16, 6, 3), {}),
    # 1-D causal, dilated, depthwise (shifted elementwise products): a 2-row halo from above.
    "causal_k3_dil2_depthwise": (mk.causal_mask(3), (4, 16, 3), {"dilation": 2, "feature_group_count": 3}),
}


def _raster_documents(seed, shape) -> np.ndarray:
    """Documents as runs of the raster order (a row-major image of ids), crossing rows and shard borders; some padding."""
    rng = np.random.default_rng(seed)
    n, size = shape[0], int(np.prod(shape[1:]))
    ids = np.empty((n, size), np.int32)
    for row in ids:
        cuts = np.sort(rng.choice(np.arange(1, size), 4, replace=False))
        row[:] = np.searchsorted(cuts, np.arange(size), side="right")
        row[row == 2] = -1
    return ids.reshape(shape)


@needs_mesh
@pytest.mark.parametrize("case", tiered(sorted(SPATIAL), lambda c: c == "pixelcnnB_3x3"))
def test_spatial_sharding_with_segment_ids_equals_one_device(case):
    mask, shape, kw = SPATIAL[case]
    mesh = _mesh((SHARDS, 2), ("h", "b"), AxisType.Explicit)
    groups = kw.get("feature_group_count", 1)
    x, k = random(60, shape), random(61, (*mask.shape, 3 // groups, 4 if groups == 1 else 3))
    ids = jnp.asarray(_raster_documents(62, shape[:-1]))

    def sharded(x, k):
        return parallel.spatially_sharded_masked_conv(
            x, k, mask, mesh=mesh, axis_name="h", batch_axis="b", segment_ids=ids, **kw
        )

    def single(x, k):
        return mk.masked_conv(x, k, mask, implementation="xla", segment_ids=ids, **kw)

    loss = lambda f: (lambda x, k: jnp.sum(jnp.sin(f(x, k))))  # noqa: E731
    y, (dx, dk) = jax.jit(sharded)(x, k), jax.jit(jax.grad(loss(sharded), (0, 1)))(x, k)
    y1, (dx1, dk1) = jax.jit(single)(x, k), jax.jit(jax.grad(loss(single), (0, 1)))(x, k)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("b", "h")), y.ndim), y.sharding
    taps, c_out = int(np.asarray(mask, bool).sum()), k.shape[-1]
    if groups > 1:
        assert_bits_equal(y, y1, "y")
    else:
        # An im2col GEMM with fewer rows per device: the dot's blocking, and with it the
        # order of its sums, may differ (1-ulp differences seen on jax 0.12's CPU dots).
        assert_close(y, y1, np.float32, taps * 3, scale=taps * 3 * float(abs(x).max() * abs(k).max()))
    # The input gradient of rows in a halo adds two shards' sums; the kernel gradient is a psum.
    assert_close(dx, dx1, np.float32, taps * c_out, scale=taps * c_out * float(abs(k).max()))
    assert_close(dk, dk1, np.float32, y1.size // 4, scale=float(abs(x).max()))
