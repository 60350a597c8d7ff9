"""masked_conv on a device mesh: data parallel for every backend, spatial sharding for "xla".

The checks need 8 devices: in an ordinary run, ``test_on_8_forced_cpu_devices`` runs
this same file in a fresh interpreter with 8 forced CPU devices
(``conftest.run_on_forced_cpu_devices``).
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.mesh import N_DEVICES, has_mesh_already, needs_mesh, run_on_forced_cpu_devices
from support.numerics import assert_close, assert_second_order_close, random, second_order
from support.tiers import tiered
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import maskconv_kernels as mk
from maskconv_kernels import parallel
from maskconv_kernels.ops.masked_conv import backends, maps
from maskconv_kernels.ops.masked_conv.reference import masked_conv_reference
from maskconv_kernels.ops.masked_conv.spec import make_spec



@has_mesh_already
def test_on_8_forced_cpu_devices():
    run_on_forced_cpu_devices(__file__)


# --------------------------------------------------------------------------- data parallel

BATCH = 16  # 2 examples per device; no other dim of the test arrays is 16.
M_A = mk.pixelcnn_mask((3, 3), "A")


# The "xla" backend as a kernel backend's record would have it: lowered through the
# batch-partitioning wrapper (custom_partitioning) the kernel backends get.
_XLA_AS_KERNEL = dataclasses.replace(backends.BACKENDS["xla"], spmd=backends.BATCH)


def _through_the_wrapper(x, kernel, mask, **kw):
    """The "xla" backend routed through the kernel-backend wrapper (custom_partitioning)."""
    return maps.masked_conv(x, kernel, make_spec(x, kernel, mask, **kw), backend=_XLA_AS_KERNEL)


def _backend(name):
    if name == "xla-as-kernel":
        return _through_the_wrapper
    interpret = name != "xla"  # the kernel backends in their interpreters; xla has none
    return lambda x, k, m, **kw: mk.masked_conv(x, k, m, implementation=name, interpret=interpret, **kw)


def _runs_on_cpu(name) -> bool:
    spec = make_spec(np.zeros((BATCH, 7, 5, 3), np.float32), np.zeros((3, 3, 3, 4), np.float32), M_A)
    return backends.get(name).unsupported(spec, "cpu", True) is None


# Every registered backend that runs on CPUs (interpret mode for kernel backends), plus
# "xla" through the wrapper the kernel backends get. Interpreters that are host callbacks
# (Triton's) are not partitioned at all (backends.Backend.host_interpret says why).
DATA_PARALLEL = [
    name for name in sorted(mk.IMPLEMENTATIONS) if _runs_on_cpu(name) and backends.get(name).interpreter is None
] + ["xla-as-kernel"]


def _mesh(shape, names, axis_type):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _hlo(fn, *args) -> str:
    return fn.lower(*args).compile().as_text()


@functools.lru_cache(maxsize=None)
def _one_device_cached():
    # One device, exact pure-JAX backend (kernel backends agree with it in test_agreement).
    x, k = random(0, (BATCH, 7, 5, 3)), random(1, (3, 3, 3, 4))
    single = lambda x, k: mk.masked_conv(x, k, M_A, implementation="xla")
    y, (dx, dk) = jax.jit(single)(x, k), jax.jit(jax.grad(lambda x, k: jnp.sum(jnp.sin(single(x, k))), (0, 1)))(x, k)
    return y, dx, dk


def _one_device(x, k):
    np.testing.assert_array_equal(x, random(0, (BATCH, 7, 5, 3)))
    return _one_device_cached()


# Auto: NamedSharding inputs, no mesh in context (the partitioner decides); Explicit:
# sharding in types (jax.make_mesh's default). The wrapper's own Explicit path is needed
# by kernel backends only (xla-as-kernel passes either way), so it is not run twice.
CASES = [(n, t) for n in DATA_PARALLEL for t in (AxisType.Auto, AxisType.Explicit) if (n, t.name) != ("xla-as-kernel", "Explicit")]


def _known_gather(params: list) -> list:
    """The cases with the Mosaic TPU kernels interpreted under ``Explicit`` axes marked as
    the known failure they are (strict: a fix makes them fail until the mark goes): the
    compiled program all-gathers the batch into the interpreter's loops (found on
    2026-12-07 by the slow tier's rotation, failing since the case was added, on jax
    0.10.2 and 0.12.1; ``Auto`` axes keep it split). No TPU with several chips has run it
    compiled."""
    gathers = pytest.mark.xfail(strict=True, reason="the interpreted TPU kernels gather the batch under Explicit axes")
    return [pytest.param(*p.values, marks=(*p.marks, gathers)) if p.values == ("pallas_mosaic_tpu", AxisType.Explicit)
            else p for p in params]


@needs_mesh
# Both axis types on xla; the kernel backends with Auto (the common jit program) in the fast tier,
# but for the TPU kernels (named only; interpreted, their fast tier is test_pallas_mosaic_tpu.py).
@pytest.mark.parametrize(
    "name, axis_type",
    _known_gather(tiered(
        CASES, lambda c: c[0] == "xla" or (c[1] == AxisType.Auto and c[0] != "pallas_mosaic_tpu"), spread=True)),
    ids=[f"{n}-{t.name}" for n, t in CASES],
)
def test_data_parallel_stays_sharded_and_matches_one_device(name, axis_type):
    conv = _backend(name)
    mesh = _mesh((N_DEVICES,), ("data",), axis_type)
    x, k = random(0, (BATCH, 7, 5, 3)), random(1, (3, 3, 3, 4))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ks = jax.device_put(k, NamedSharding(mesh, P()))
    loss = lambda conv: (lambda x, k: jnp.sum(jnp.sin(conv(x, k, M_A))))
    # Compiled once: the values and the HLO checked below come from the same program.
    forward = jax.jit(lambda x, k: conv(x, k, M_A)).lower(xs, ks).compile()
    gradients = jax.jit(jax.grad(loss(conv), (0, 1))).lower(xs, ks).compile()

    y, (dx, dk) = forward(xs, ks), gradients(xs, ks)
    batch = NamedSharding(mesh, P("data"))
    assert y.sharding.is_equivalent_to(batch, y.ndim), y.sharding
    assert dx.sharding.is_equivalent_to(batch, dx.ndim), dx.sharding
    assert dk.sharding.is_fully_replicated, dk.sharding

    y1, dx1, dk1 = _one_device(x, k)
    taps = len(M_A.nonzero()[0])
    assert_close(y, y1, np.float32, reduction=taps * 3, scale=float(abs(x).max() * abs(k).max()))
    assert_close(dx, dx1, np.float32, reduction=taps * 4, scale=float(abs(k).max()))
    assert_close(dk, dk1, np.float32, reduction=y1.size // 4, scale=float(abs(x).max()))

    for compiled in (forward, gradients):
        text = compiled.as_text()
        assert "all-gather" not in text, f"{name}: the compiled program gathers:\n{text}"
        # No device ever holds the whole batch of inputs or outputs.
        assert not re.search(rf"f32\[{BATCH},7,5,[34]\]", text), f"{name}: a device holds the whole batch:\n{text}"
    # The kernel gradient is the sum over devices of each device's examples.
    assert "all-reduce" in gradients.as_text()


@needs_mesh
@pytest.mark.slow  # on one device, test_transforms.py's; here the wiring on a mesh
def test_wrapper_vmap_and_second_derivatives_on_a_mesh():
    mesh = _mesh((N_DEVICES,), ("data",), AxisType.Auto)
    x, k = random(2, (N_DEVICES, 4, 5, 3)), random(3, (3, 3, 3, 4))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    # vmap over examples of examples (folded into one partitioned call) and over kernels.
    folded = jax.jit(jax.vmap(lambda x: _through_the_wrapper(x, k, M_A)))(jnp.stack([xs, 2 * xs]))
    reduction, scale = int(M_A.sum()) * 3, float(abs(x).max() * abs(k).max())
    assert_close(folded[1], masked_conv_reference(2 * x, k, M_A), np.float32, reduction, 2 * scale)
    per_kernel = jax.jit(jax.vmap(lambda k: _through_the_wrapper(xs, k, M_A)))(jnp.stack([k, -k]))
    assert_close(per_kernel[1], masked_conv_reference(x, -k, M_A), np.float32, reduction, scale)
    assert_second_order_close(jax.jit(lambda k: second_order(_through_the_wrapper, xs, k, M_A))(k), x, k, M_A)


# --------------------------------------------------------------------------- spatial

SPATIAL = {
    # A causal mask: the halo comes from above only.
    "pixelcnnA_3x3": (mk.pixelcnn_mask((3, 3), "A"), (4, 16, 6, 3), {}),
    # Every tap: halos from both sides; stride 2 in both dims.
    "full_3x3_stride2": (np.ones((3, 3), bool), (4, 16, 6, 3), {"strides": 2}),
    # 1-D causal sequence, dilated: a 2-row halo from above.
    "causal_k3_dil2": (mk.causal_mask(3), (4, 16, 3), {"dilation": 2}),
}


def _spatial(mesh, mask, **kw):
    return lambda x, k: parallel.spatially_sharded_masked_conv(
        x, k, mask, mesh=mesh, axis_name="h", batch_axis="b", implementation="xla", **kw
    )


@needs_mesh
@pytest.mark.parametrize("case", sorted(SPATIAL))
def test_spatial_sharding_matches_one_device(case):
    mask, shape, kw = SPATIAL[case]
    mesh = _mesh((4, 2), ("h", "b"), AxisType.Explicit)
    x, k = random(4, shape), random(5, (*mask.shape, 3, 4))
    sharded, single = _spatial(mesh, mask, **kw), lambda x, k: mk.masked_conv(x, k, mask, implementation="xla", **kw)
    loss = lambda f: (lambda x, k: jnp.sum(jnp.sin(f(x, k))))
    y, (dx, dk) = jax.jit(sharded)(x, k), jax.jit(jax.grad(loss(sharded), (0, 1)))(x, k)
    y1, (dx1, dk1) = jax.jit(single)(x, k), jax.jit(jax.grad(loss(single), (0, 1)))(x, k)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("b", "h")), y.ndim), y.sharding
    reduction = int(mask.sum()) * 3
    assert_close(y, y1, np.float32, reduction, scale=float(abs(x).max() * abs(k).max()))
    assert_close(dx, dx1, np.float32, reduction, scale=float(abs(k).max()))
    assert_close(dk, dk1, np.float32, y1.size // 4, scale=float(abs(x).max()))


def _permute_pairs(text: str) -> set[tuple[int, int]]:
    pairs = set()
    for group in re.findall(r"source_target_pairs=\{(.*?)\}\}", text):
        pairs |= {(int(a), int(b)) for a, b in re.findall(r"(\d+),(\d+)", group)}
    return pairs


@needs_mesh
def test_spatial_halo_is_exact_nan_below_a_border_never_reaches_rows_above():
    # 8 shards of 2 rows; type-B PixelCNN mask: output row r reads rows r-1 and r only.
    mask = mk.pixelcnn_mask((3, 3), "B")
    mesh = _mesh((N_DEVICES,), ("h",), AxisType.Auto)
    conv = lambda x, k: parallel.spatially_sharded_masked_conv(x, k, mask, mesh=mesh, axis_name="h")
    x, k = random(6, (2, 16, 5, 3)), random(7, (3, 3, 3, 4))
    forward = jax.jit(conv)
    clean = np.asarray(forward(x, k))
    np.testing.assert_array_equal(np.isfinite(clean), True)

    # The loss on the rows above a border, with the border a traced value (one compile).
    def loss(x, k, border):
        y = conv(x, k)
        above = jnp.arange(y.shape[1])[None, :, None, None] < border
        return jnp.sum(jnp.where(above, y, 0.0) ** 2)

    grad_x = jax.jit(jax.grad(loss))
    for border in range(2, 16, 2):
        poisoned = x.at[:, border:].set(jnp.nan)
        y = np.asarray(forward(poisoned, k))
        # Bit-identical above the border, in every shard (not only the one next to it).
        np.testing.assert_array_equal(y[:, :border], clean[:, :border], err_msg=f"border at row {border}")
        # Backward: exactly zero gradient below the border, bit-identical above it. (The
        # kernel gradient is NaN, as on one device: it multiplies the poisoned inputs by
        # their zero cotangents.)
        dx, dx_clean = np.asarray(grad_x(poisoned, k, border)), np.asarray(grad_x(x, k, border))
        assert (dx[:, border:] == 0).all(), f"border at row {border}"
        np.testing.assert_array_equal(dx[:, :border], dx_clean[:, :border], err_msg=f"border at row {border}")
    # Causal: halos only travel downwards (device i to i + 1), forward and backward of the
    # forward (the backward's transpose sends gradients back up, which is allowed).
    text = _hlo(forward, x, k)
    pairs = _permute_pairs(text)
    assert pairs and all(b == a + 1 for a, b in pairs), pairs
    assert "all-gather" not in text


@needs_mesh
def test_spatial_sharding_limits_are_reported():
    mesh = _mesh((N_DEVICES,), ("h",), AxisType.Explicit)
    k = random(8, (3, 3, 3, 4))
    full = np.ones((3, 3), bool)
    def call(x, axis_name="h", **kw):
        return parallel.spatially_sharded_masked_conv(x, k, full, mesh=mesh, axis_name=axis_name, **kw)

    with pytest.raises(ValueError, match="multiple of 8 shards"):
        call(random(9, (1, 12, 4, 3)))
    with pytest.raises(ValueError, match="padding='SAME'"):
        call(random(9, (1, 16, 4, 3)), padding="VALID")
    with pytest.raises(ValueError, match="use at most 5 shards"):
        # 2 rows per shard, a 7-row window needs 3 from each side.
        parallel.spatially_sharded_masked_conv(
            random(9, (1, 16, 4, 3)), random(8, (7, 3, 3, 4)), np.ones((7, 3)), mesh=mesh, axis_name="h"
        )
    with pytest.raises(ValueError, match="not an axis"):
        call(random(9, (1, 16, 4, 3)), axis_name="rows")


@needs_mesh
def test_export_for_cuda_works_in_a_process_with_several_devices():
    """Kernel lowerings are partitioned where devices are known; an export has none to partition over."""
    from support.lowering import cuda_lowering
    from jax import export

    x, k = random(0, (2, 8, 8, 16)), random(1, (3, 3, 16, 16), scale=0.1)
    f = jax.jit(jax.value_and_grad(lambda x, k: mk.masked_conv(x, k, M_A).sum(), (0, 1)))
    with cuda_lowering():
        exported = export.export(
            f, platforms=("cpu", "cuda"), disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        )(x, k)
    assert 'name = "maskconv_fwd"' in exported.mlir_module()
    # The loss sums every output: a float32 sum of all active products, against float64.
    y64 = masked_conv_reference(x, k, M_A)
    scale = float(jnp.abs(x).max() * jnp.abs(k).max())
    assert_close(exported.call(x, k)[0], y64.sum(), np.float32, y64.size * int(M_A.sum()) * 16, scale)


# --------------------------------------------------------------------------- causal_conv1d's kernels

SHORT_BATCH = 16  # 2 rows per device; no other dim of the test arrays is 16.
SHORT_DIM = 256  # 64 channels per device on the model axis; no other dim of the test arrays is 256.


@needs_mesh
@pytest.mark.parametrize("implementation, channels", [
    ("pallas_triton", False), ("xla", False), ("pallas_triton", True), ("pallas_mosaic_tpu", True),
], ids=["pallas_triton-rows", "xla-rows", "pallas_triton-rows_and_channels", "pallas_mosaic_tpu-rows_and_channels"])
def test_causal_conv1d_stays_sharded_and_matches_one_device(implementation, channels):
    """The short conv's kernels are batch-partitioned like masked_conv's (one kernel framework):
    rows, segment ids and states split across devices, weight and bias gradients summed.
    With ``channels`` (tensor parallelism) the channels are split over a model axis too,
    and the kernels run on each device's rows and channels (a depthwise op: a channel reads
    only itself): the weight and bias gradients stay split by channel, summed over the data
    axis only."""
    interpret = implementation != "xla"  # the fused kernels in Pallas' interpreter, traced inline
    mesh = _mesh((2, N_DEVICES // 2), ("data", "model"), AxisType.Auto) if channels else _mesh(
        (N_DEVICES,), ("data",), AxisType.Auto)
    model = "model" if channels else None
    x, w, b = random(10, (SHORT_BATCH, 12, SHORT_DIM)), random(11, (4, SHORT_DIM), scale=0.5), random(12, (SHORT_DIM,))
    state = random(13, (SHORT_BATCH, 3, SHORT_DIM))
    ids = jnp.asarray(np.repeat([[0] * 5 + [1] * 7], SHORT_BATCH, axis=0))

    def conv(x, w, b, state, ids, implementation=implementation, interpret=interpret):
        return mk.causal_conv1d(x, w, b, segment_ids=ids, initial_state=state, activation="silu",
                                implementation=implementation, interpret=interpret)

    loss = lambda conv: (lambda x, w, b, state, ids: jnp.sum(jnp.sin(conv(x, w, b, state, ids))))
    split, by_channel = NamedSharding(mesh, P("data", None, model)), NamedSharding(mesh, P(None, model))
    bias = NamedSharding(mesh, P(model))
    args = (jax.device_put(x, split), jax.device_put(w, by_channel), jax.device_put(b, bias),
            jax.device_put(state, split), jax.device_put(ids, NamedSharding(mesh, P("data"))))
    forward = jax.jit(conv).lower(*args).compile()
    gradients = jax.jit(jax.grad(loss(conv), (0, 1, 2, 3))).lower(*args).compile()
    y, (dx, dw, db, dstate) = forward(*args), gradients(*args)
    for a in (y, dx, dstate):
        assert a.sharding.is_equivalent_to(split, a.ndim), a.sharding
    assert dw.sharding.is_equivalent_to(by_channel, 2), dw.sharding
    assert db.sharding.is_equivalent_to(bias, 1), db.sharding

    one = functools.partial(conv, implementation="xla", interpret=False)
    y1 = jax.jit(one)(x, w, b, state, ids)
    dx1, dw1, db1, dstate1 = jax.jit(jax.grad(loss(one), (0, 1, 2, 3)))(x, w, b, state, ids)
    assert_close(y, y1, np.float32, reduction=4, scale=float(abs(x).max() * abs(w).max()) + 1.0)
    for got, want, reduction in ((dx, dx1, 4), (dstate, dstate1, 4), (dw, dw1, SHORT_BATCH * 12),
                                 (db, db1, SHORT_BATCH * 12)):
        assert_close(got, want, np.float32, reduction=reduction, scale=float(abs(want).max()) + 1.0)
    for compiled in (forward, gradients):
        text = compiled.as_text()
        assert "all-gather" not in text, f"{implementation}: the compiled program gathers:\n{text}"
        assert not re.search(rf"f32\[{SHORT_BATCH},12,", text), f"{implementation}: a device holds every row"
        if channels:
            assert not re.search(rf"f32\[\d+,\d+,{SHORT_DIM}\]", text), f"{implementation}: a device holds every channel"
    assert "all-reduce" in gradients.as_text()


def _serving_args(kind: str):
    """A step's arguments: ``mixed`` (a 5-token chunk, two decode rows, a fresh 5-token
    chunk, then padding), ``written`` (the same, the fresh chunk's state written to another
    slot: the step checks for races, with the composition as its other branch), ``decode``
    (a token for each of 4 rows: the decode kernel, the mixed one as its other branch)."""
    x = random(30, (4 if kind == "decode" else 16, SHORT_DIM))
    pool, w, b = random(31, (8, 3, SHORT_DIM)), random(32, (4, SHORT_DIM), scale=0.5), random(33, (SHORT_DIM,))
    if kind == "decode":
        return x, pool, w, b, dict(query_start_loc=jnp.arange(5), state_indices=jnp.array([2, 0, 7, 4]))
    kw = dict(query_start_loc=jnp.array([0, 5, 6, 7, 12]), state_indices=jnp.array([0, 3, 1, 5]),
              has_initial_state=jnp.array([True, True, True, False]))
    if kind == "written":
        kw["write_indices"] = jnp.array([0, 3, 1, 6])
    return x, pool, w, b, kw


@needs_mesh
# How many calls the lowered step hands to XLA's partitioner with their rule: its kernels
# (and with races to check, the composition's causal_conv1d forward).
@pytest.mark.parametrize("kind, partitioned", [("mixed", 1), ("written", 2), ("decode", 2)])
def test_serving_steps_stay_channel_sharded_and_match_one_device(kind, partitioned):
    """Tensor-parallel serving: with the channels of the tokens, the pool, the weight and the
    bias split over a model axis, ``causal_conv1d_step``'s kernels (the mixed step's, the
    decode step's; Mosaic TPU, interpreted) run on each device's channels, the step's
    metadata replicated: outputs and pool stay split, nothing is gathered, and they equal
    one device's composition (the pool bit for bit); the donated pool is updated in place."""
    mesh = _mesh((N_DEVICES,), ("model",), AxisType.Auto)
    x, pool, w, b, kw = _serving_args(kind)

    def step(x, pool, w, b, implementation="pallas_mosaic_tpu", interpret=True):
        return mk.causal_conv1d_step(x, pool, w, b, **kw, activation="silu", implementation=implementation,
                                     interpret=interpret)

    tokens, slots = NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P(None, None, "model"))
    args = (jax.device_put(x, tokens), jax.device_put(pool, slots), jax.device_put(w, tokens),
            jax.device_put(b, NamedSharding(mesh, P("model"))))
    lowered = jax.jit(step, donate_argnums=1).lower(*args)
    # The kernel is handed to XLA's partitioner with its rule (interpreted, it is XLA's own
    # loops, which XLA could split itself here; compiled, a custom call it could not).
    assert lowered.as_text().count("@CustomSPMDPartitioning") == partitioned
    compiled = lowered.compile()
    y, new = compiled(*args)
    assert y.sharding.is_equivalent_to(tokens, 2), y.sharding
    assert new.sharding.is_equivalent_to(slots, 3), new.sharding
    text = compiled.as_text()
    assert "all-gather" not in text, f"{kind}: the compiled program gathers:\n{text}"
    assert not re.search(rf"f32\[\d+,{SHORT_DIM}\]|f32\[8,3,{SHORT_DIM}\]", text), f"{kind}: a device holds every channel"
    assert "input_output_alias={ {1}: (1, {}" in text, "each device's slice of the donated pool is the new one's"

    y1, new1 = jax.jit(functools.partial(step, implementation="xla", interpret=False))(x, pool, w, b)
    assert_close(y, y1, np.float32, reduction=4, scale=float(abs(x).max() * abs(w).max()) + 1.0)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(new1))
