"""Every benchmark shape (maskconv_kernels.bench.shapes, the roofline's too), checked for correctness at batch 1.

The benchmarks time these real-model layers; this makes sure each implementation
computes them right first. The reference is a float64 loop over active taps (one
matmul per tap, written here because the package's per-channel oracle is too slow at
256 channels x 16k samples); values are compared with the suite's tolerances.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from support.numerics import assert_close, random
from support.tiers import tiered

from maskconv_kernels.bench import conv as bench
from maskconv_kernels.bench import roofline
from maskconv_kernels.bench.machine import metadata
from maskconv_kernels.bench.shapes import HEADLINE_SHAPES, ROOFLINE_SHAPES, SHAPES, BenchShape
from maskconv_kernels.ops.masked_conv.spec import make_spec


def _tap_views(xp, spec):
    for tap in spec.mask.active_taps:
        yield tap, tuple(slice(t * d, t * d + o) for t, d, o in zip(tap, spec.dilation, spec.out_spatial))


def _reference(x, k, dy, spec):
    """Float64 ``(y, dx, dk)`` of a stride-1, ungrouped, window-masked convolution."""
    x, k, dy = (np.asarray(a, np.float64) for a in (x, k, dy))
    pads = [(0, 0), *spec.padding, (0, 0)]
    xp = np.pad(x, pads)
    y = np.zeros((x.shape[0], *spec.out_spatial, spec.c_out))
    dxp = np.zeros_like(xp)
    dk = np.zeros_like(k)
    dy2 = dy.reshape(-1, spec.c_out)
    for tap, window in _tap_views(xp, spec):
        view = np.ascontiguousarray(xp[(slice(None), *window)]).reshape(-1, spec.c_in)  # 2-D: one BLAS call
        y += (view @ k[tap]).reshape(y.shape)
        dxp[(slice(None), *window)] += (dy2 @ k[tap].T).reshape(*y.shape[:-1], spec.c_in)
        dk[tap] = view.T @ dy2
    dx = dxp[(slice(None), *(slice(lo, lo + n) for (lo, _), n in zip(spec.padding, spec.in_spatial)))]
    return y, dx, dk


_REFERENCES: dict[str, tuple] = {}


# The headline and roofline shapes in the fast tier, the grid's others in the slow tier.
@pytest.mark.parametrize(
    "shape", tiered(SHAPES + ROOFLINE_SHAPES, lambda s: s in HEADLINE_SHAPES or s in ROOFLINE_SHAPES), ids=lambda s: s.name,
)
def test_benchmark_shape_matches_float64(conv, shape: BenchShape):
    if conv.slow:
        pytest.skip(f"{conv.name} runs in interpret mode here, too slow for real-model sizes; tests/cases.py covers it")
    x = random(11, shape.x_shape(1))
    k = random(12, shape.kernel_shape, scale=1 / np.sqrt(shape.active_taps * shape.c_in))
    spec = make_spec(x, k, shape.mask, **shape.conv_args)
    assert spec.strides == (1,) * spec.ndim and spec.groups == 1, "the float64 reference here assumes these"
    dy = random(13, (1, *spec.out_spatial, shape.c_out))

    # IEEE float32 products on every platform (no TF32), so the float32 tolerance holds on GPUs too.
    def f(x, k):
        return conv(x, k, shape.mask, precision="highest", **shape.conv_args)

    @jax.jit
    def forward_backward(x, k, dy):
        y, pull = jax.vjp(f, x, k)
        return y, *pull(dy)

    y, dx, dk = forward_backward(x, k, dy)
    if shape.name not in _REFERENCES:  # the float64 loop is the slow part: once per shape, not per backend
        _REFERENCES[shape.name] = _reference(x, k, dy, spec)
    y_ref, dx_ref, dk_ref = _REFERENCES[shape.name]
    mx, mk_, mdy = (float(np.abs(np.asarray(a)).max()) for a in (x, k, dy))
    assert_close(y, y_ref, np.float32, shape.active_taps * shape.c_in, mx * mk_, precision="highest")
    assert_close(dx, dx_ref, np.float32, shape.active_taps * shape.c_out, mdy * mk_, precision="highest")
    assert_close(dk, dk_ref, np.float32, int(np.prod(spec.out_spatial)), mx * mdy, precision="highest")
    # Masked kernel entries get no gradient at all.
    assert (np.asarray(dk)[~np.asarray(shape.mask, bool)] == 0.0).all()


def test_shapes_cover_the_models():
    names = [s.name for s in SHAPES]
    first = [s for s in SHAPES if s.window == (7, 7) and s.active_taps == 24]
    assert {s.c_in for s in first} >= {1, 3}, "PixelCNN type-A first layers with 1 and 3 input channels"
    type_b = [s for s in SHAPES if s.family == "pixelcnn" and s.active_taps in (5, 13)]
    assert {s.window for s in type_b} == {(3, 3), (5, 5)}
    assert {s.spatial for s in type_b} == {(28, 28), (32, 32), (64, 64)}
    assert {64, 128, 256} <= {s.c_in for s in type_b}
    assert any("vstack" in n for n in names) and any("hstack" in n for n in names)
    wavenet = [s for s in SHAPES if s.family == "wavenet"]
    assert {s.spatial for s in wavenet} == {(16384,)}
    assert {s.conv_args["dilation"] for s in wavenet} >= {1, 512}
    assert {s.window for s in wavenet} == {(2,), (3,)}
    assert {s.c_in for s in wavenet} >= {64, 256}
    assert len(set(names)) == len(names)
    assert {(s.window, s.spatial, s.c_in) for s in HEADLINE_SHAPES} == {((7, 7), (32, 32), 256), ((3, 3), (32, 32), 256)}


@pytest.mark.slow  # the fast tier runs the shapes against float64
def test_benchmark_cell_reports_exactness_and_metadata():
    """The runner on one tiny cell: every row carries metadata; exactness is measured, not assumed."""
    shape = BenchShape("tiny_3x3A", "pixelcnn", (9, 9), 4, 4, np.asarray(SHAPES[0].mask[2:5, 2:5]), 2, 2)
    preset = bench.PRESETS["quick"]
    meta = metadata("quick", "test")
    rows = bench.run_cell(shape, "float32", "fwd+bwd", preset, meta, {"float32": 1e9}, jax.default_backend(), None)
    by_impl = {r["implementation"]: r for r in rows}
    assert "baseline" in by_impl and "xla" in by_impl
    for r in rows:
        assert "error" not in r, r["error"]
        for key in ("device", "jax", "jaxlib", "commit", "time_utc", "cpu_model", "median_s", "p20_s", "p80_s",
                    "compile_s", "peak_bytes", "leak_max_abs", "nan_isolated", "speedup"):
            assert key in r, key
        assert r["p20_s"] <= r["median_s"] <= r["p80_s"]
        assert r["leak_field_reached"]
    # Exact: masked taps are never read. The baseline multiplies NaN by a zero kernel entry.
    assert by_impl["xla"]["leak_max_abs"] == 0.0 and by_impl["xla"]["nan_isolated"]
    assert not by_impl["baseline"]["nan_isolated"] and by_impl["baseline"]["nan_changed"] > 0
    # The values, next to the baseline's on the same inputs: float32 rounding only, for every output.
    assert 0 <= by_impl["xla"]["max_rel_diff"] < 1e-5 and "max_rel_diff" not in by_impl["baseline"]


@pytest.mark.slow
def test_roofline_rows_carry_rates_efficiencies_memory_and_metadata():
    """The roofline on one tiny shape: a row per map and strategy, each set against its GEMM."""
    shape = BenchShape("tiny_3x3B", "pixelcnn", (6, 6), 4, 4, np.asarray(ROOFLINE_SHAPES[2].mask), 2, 2)
    quick = dataclasses.replace(roofline.TIMING, samples=2, min_sample_s=0.0)
    rows = roofline.measure_shape(shape, "float32", [1.0], metadata("roofline", "test"), quick)
    maps = [r for r in rows if r["map"] in roofline.MAPS and r["strategy"] != "GEMM"]
    strategies = {r["strategy"] for r in maps}
    assert strategies == {*roofline.STRATEGIES, "gemm 1 MiB", "conv_blocks 1 MiB", roofline.LAX}
    assert len(maps) == 3 * len(strategies)
    for r in rows:
        for key in ("device", "jax", "jaxlib", "commit", "time_utc", "loadavg", "median_s", "gflops", "temp_bytes"):
            assert key in r, key
    for r in maps:
        assert r["efficiency"] > 0 and r["extra_over_x"] >= 0
    (ours,) = [r for r in rows if r["map"] == "fwd+bwd" and r["strategy"] == "default"]
    assert ours["tap_ratio"] == 9 / 5 and ours["speedup"] > 0
    # A table line per map, strategy and GEMM, and one for forward+backward.
    assert roofline.table(rows).count("| tiny_3x3B | float32 |") == len(maps) + 3 + 1
