"""The causal_conv benchmark (maskconv_kernels.bench causal_conv) compares like with like, and its rows carry their
metadata and memory."""
from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from support.numerics import assert_close

from maskconv_kernels.bench import causal_conv as bench
from maskconv_kernels.bench.__main__ import main
from maskconv_kernels.bench.shapes import CAUSAL_SHAPES

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
QUICK = bench.PRESETS["quick"][1]


@pytest.mark.parametrize("shape", QUICK, ids=lambda s: s.name)
def test_the_baseline_computes_what_causal_conv_computes(shape):
    """Full pass (y and the three gradients) and one streamed chunk (y and the frames kept): the same values."""
    (x, k, b, dy), = bench._inputs(shape, 1, np.float32, 1)
    ours = jax.jit(bench.mode_fn(bench.ours(shape), "fwd+bwd"))(x, k, b, dy)
    base = jax.jit(bench.mode_fn(bench.baseline(shape), "fwd+bwd"))(x, k, b, dy)
    taps, positions = int(np.prod(shape.window)), shape.out_frames * int(np.prod(shape.spatial))
    mx, mk, mdy = (float(np.abs(np.asarray(a)).max()) for a in (x, k, dy))
    scale = mx * mk + float(np.abs(np.asarray(b)).max())
    (y, (dx, dk, db)), (y_ref, (dx_ref, dk_ref, db_ref)) = ours, base
    assert_close(y, y_ref, np.float32, taps * shape.c_in, scale)
    assert_close(dx, dx_ref, np.float32, taps * shape.c_out, mdy * mk)
    assert_close(dk, dk_ref, np.float32, positions, mdy * mx)
    assert_close(db, db_ref, np.float32, positions, mdy)

    sets = bench.stream_inputs(shape, [(x, k, b, dy)])
    (y_chunk, state), = [jax.jit(bench.ours_step(shape))(*a) for a in sets[bench.STREAM_OURS]]
    (y_base, cache), = [jax.jit(bench.baseline_step(shape))(*a) for a in sets[bench.STREAM_BASELINE]]
    outs = shape.chunk // shape.stride  # the second chunk's outputs are these of the full pass
    assert y_chunk.shape == y_base.shape == (1, outs, *y.shape[2:])
    assert_close(y_chunk, y_base, np.float32, taps * shape.c_in, scale)
    assert_close(y_chunk, y[:, outs:2 * outs], np.float32, taps * shape.c_in, scale)
    np.testing.assert_array_equal(state.frames, cache)  # both keep the last k_T - 1 frames


@pytest.mark.slow  # a whole benchmark run
def test_a_tiny_run_writes_rows_with_metadata_and_memory(tmp_path):
    """The quick preset's 1-D layer end to end: a row per side and mode, with the machine, the memory and the
    targets (its 3-D layer compiles for seconds more; the test above runs it)."""
    assert main(["causal_conv", "--quick", "--shapes", "tiny_audio", "--no-chart", "--out", str(tmp_path),
                 "--name", "q"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    (shape,) = [s for s in QUICK if "tiny_audio" in s.name]
    assert len(rows) == 2 * len(bench.MODES)
    assert {r["implementation"] for r in rows} == {bench.OURS, bench.BASELINE, bench.STREAM_OURS,
                                                   bench.STREAM_BASELINE}
    for r in rows:
        assert "error" not in r, r["error"]
        for key in ("device", "cpu_model", "jax", "jaxlib", "python", "commit", "time_utc", "loadavg_at_start",
                    "command", "median_s", "p20_s", "p80_s", "compile_s", "speedup"):
            assert key in r, key
        assert r["p20_s"] <= r["median_s"] <= r["p80_s"]
        # Memory of each compiled executable, ours and the baseline's alike.
        for key in ("temp_bytes", "output_bytes", "peak_bytes"):
            assert isinstance(r[key], int), key
        assert r["mem_bytes"] == r["temp_bytes"] + r["output_bytes"] > 0
    for r in rows:
        if r["mode"] == "stream":
            assert r["share_s"] == pytest.approx(r["chunk"] / r["frames"] * r["full_pass_s"])
            assert r["vs_share"] == pytest.approx(r["median_s"] / r["share_s"])
        if r["implementation"] in (bench.OURS, bench.STREAM_OURS):
            assert r["max_abs_diff"] < 1e-4  # measured on the timed executables
        if r["mode"] != "stream":  # exactness on the timed executables, the strided audio layer's
            assert r["nan_isolated"] and r["nan_changed"] == 0 < r["nan_clean_outputs"]
            assert (r["leak_max_abs"] == 0.0 and r["leak_field_reached"]) if r["mode"] == "fwd+bwd" else (
                "leak_max_abs" not in r)
    text = (tmp_path / "q.md").read_text()
    assert text.startswith("Device:") and "## Targets" in text
    assert f"| {shape.name} | float32 | fwd+bwd |" in bench.targets(rows)
    assert f"| {shape.name} | float32 | {shape.chunk} |" in bench.targets(rows)


def test_the_shapes_are_the_layers_of_video_vaes_and_audio_codecs():
    video = [s for s in CAUSAL_SHAPES if s.family == "video"]
    audio = [s for s in CAUSAL_SHAPES if s.family == "audio"]
    assert {s.window for s in video} == {(3, 3, 3)} and {s.batch for s in video} == {1}
    assert {s.stride for s in video} == {1, 2} and {s.padding_mode for s in video} == {"zeros", "replicate"}
    assert all(9 <= s.frames <= 17 and 32 <= s.spatial[0] <= 64 and 128 <= s.c_in <= 256 for s in video)
    assert {s.frames for s in audio} == {24000} and {s.stride for s in audio} >= {2, 4, 5, 8}
    assert all(3 <= s.window[0] <= 16 and 64 <= max(s.c_in, s.c_out) <= 512 for s in audio)
    assert all(s.chunk % s.stride == 0 and s.chunk >= s.window[0] - 1 for s in CAUSAL_SHAPES)
    assert len({s.name for s in CAUSAL_SHAPES}) == len(CAUSAL_SHAPES)
    cpu = bench.PRESETS["cpu"][1]
    assert {s.family for s in cpu} == {"video", "audio"} and set(cpu) < set(bench.PRESETS["gpu"][1])


@pytest.mark.parametrize("path", sorted(RESULTS.glob("causal_conv_*.jsonl")), ids=lambda p: p.stem)
def test_the_committed_results_render_as_this_benchmark(path, tmp_path, capsys):
    assert main(["render", str(path), "--out", str(tmp_path), "--no-chart"]) == 0
    assert "## Targets" in capsys.readouterr().out
    assert (tmp_path / f"{path.stem}.md").read_text().startswith("Device:")
