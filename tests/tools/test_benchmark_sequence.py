"""The sequence benchmark (maskconv_kernels.bench.sequence) compares like with like, and its rows carry their metadata."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from support.numerics import assert_close

from maskconv_kernels.bench import sequence
from maskconv_kernels.bench.__main__ import main


@pytest.mark.slow
def test_the_three_formulations_compute_the_same_function():
    """causal_conv1d, lax.conv depthwise and the shift-and-add: silu(conv + bias) rounded once, and the same gradients."""
    preset, (shape,) = sequence.PRESETS["quick"]
    (x, w, b, dy), = sequence._inputs(shape, np.float32, 1)
    found = sequence.formulations("cpu", "cpu")  # the fused kernels' own tests compare them
    outs = {name: jax.jit(sequence.mode_fn(f, "fwd+bwd"))(x, w, b, dy) for name, f in found.items()}
    ref_y, (ref_dx, ref_dw, ref_db) = outs[sequence.SHIFT]
    scale = float(np.abs(np.asarray(x)).max() * np.abs(np.asarray(w)).max()) + 1
    for name, (y, (dx, dw, db)) in outs.items():
        assert_close(y, ref_y, np.float32, 2 * shape.width, scale)
        assert_close(dx, ref_dx, np.float32, 2 * shape.width, scale)
        assert_close(dw, ref_dw, np.float32, 2 * shape.batch * shape.length, scale * 4)
        assert_close(db, ref_db, np.float32, 2 * shape.batch * shape.length, 4.0)


@pytest.mark.slow
def test_a_cell_times_every_formulation_with_metadata(tmp_path):
    """The quick preset end to end (the fused kernels interpreted): rows, metadata, tables."""
    assert main(["sequence", "--preset", "quick", "--modes", "fwd+bwd", "--no-chart", "--out", str(tmp_path),
                 "--name", "q"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert {r["implementation"] for r in rows} == set(sequence.formulations("cpu", "quick"))
    for r in rows:
        assert "error" not in r, r["error"]
        for key in ("device", "jax", "commit", "time_utc", "median_s", "p20_s", "p80_s", "roofline_s", "ideal_bytes"):
            assert key in r, key
        assert r["p20_s"] <= r["median_s"] <= r["p80_s"]
    ours = next(r for r in rows if r["implementation"] == sequence.OURS)
    assert ours["vs_lax.conv"] > 0 and ours["vs_shift-and-add"] > 0
    assert all(r["max_abs_diff_vs_shift"] < 1e-5 for r in rows)  # the first cell's outputs, compared
    # Exactness on the timed executables: on a CPU every formulation is causal, lax.conv too.
    assert all(r["leak_max_abs"] == 0.0 and r["leak_field_reached"] and r["nan_isolated"] for r in rows)
    assert f"| {ours['shape']} | float32 | causal_conv1d |" in sequence.targets(rows)
    assert (tmp_path / "q.md").read_text().startswith("Device:")


def test_the_decode_steps_compute_the_same_step():
    """One token for each row: the output and the new state, alike in the three formulations."""
    preset, (shape,) = sequence.PRESETS["quick"]
    (x, w, b, state), = sequence._inputs(shape, np.float32, 1, "decode")
    assert x.shape == (shape.batch, shape.dim) and state.shape == (shape.batch, shape.width - 1, shape.dim)
    outs = {name: jax.jit(step)(x, w, b, state) for name, step in sequence.STEPS.items()}
    ref_y, ref_state = outs[sequence.SHIFT]
    for name, (y, new_state) in outs.items():
        assert_close(y, ref_y, np.float32, 2 * shape.width, float(np.abs(np.asarray(x)).max()) + 1)
        np.testing.assert_array_equal(new_state, ref_state)
