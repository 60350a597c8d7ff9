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


def test_a_row_gives_the_fraction_of_its_dtypes_copy_rate():
    """Given copy rates (measured on TPUs only), a cell's rows carry theirs and the fraction of
    it their bytes reached; the table shows it, and a dash where none was measured."""
    preset, (shape,) = sequence.PRESETS["quick"]
    rate = sequence.measure_copy_rate(preset, np.float32, mib=1)
    assert rate > 0 and sequence.copy_rates("cpu", preset) == {}
    found = {name: f for name, f in sequence.formulations("cpu", "cpu").items() if name == sequence.SHIFT}
    rows = sequence.run_cell(shape, "float32", "fwd", preset, {}, 1e9, found, rates={"float32": rate})
    (row,) = rows
    assert row["copy_bytes_per_s"] == rate
    assert row["frac_copy"] == pytest.approx(row["ideal_bytes"] / rate / row["median_s"])
    assert _cell(sequence.markdown(rows), "of the copy rate") == f"{100 * row['frac_copy']:.0f}%"
    (plain,) = sequence.run_cell(shape, "float32", "fwd", preset, {}, 1e9, found)
    assert plain["copy_bytes_per_s"] is None and "frac_copy" not in plain
    assert _cell(sequence.markdown([plain]), "of the copy rate") == "—"


def _cell(table: str, column: str) -> str:
    """The first row's cell under ``column`` in a markdown table."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].split("|")]
    return [c.strip() for c in lines[2].split("|")][header.index(column)]
