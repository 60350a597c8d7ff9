"""benchmarks/tpu_bandwidth.py: its copies copy, and its rows carry their rates and metadata (Pallas interpreted here)."""
from __future__ import annotations

import json

import pytest

from benchmarks import tpu_bandwidth


@pytest.mark.slow
def test_small_run_writes_a_row_per_copy_and_kernel(tmp_path):
    rows = tpu_bandwidth.main(["--small", "--out", str(tmp_path)])  # each copy checked against x inside
    written = [json.loads(line) for line in (tmp_path / "tpu_bandwidth.jsonl").read_text().splitlines()]
    assert written == json.loads(json.dumps(rows))
    full, half = list(tpu_bandwidth.SMALL_SHAPE), list(tpu_bandwidth.SMALL_SHAPE[:2]) + [512]
    arrays = (("bfloat16", full), ("float32", full), ("float32", half))
    copies = sorted((r["copy"], r["dtype"], r["shape"]) for r in rows if "copy" in r)
    assert copies == sorted((name, dtype, shape) for dtype, shape in arrays
                            for name in tpu_bandwidth.copies(True, True, tuple(shape)))
    wide = tuple(tpu_bandwidth.SMALL_SHAPE[:2]) + (tpu_bandwidth.SMALL_BLOCKS[0][1] // 2,)
    assert not [name for name in tpu_bandwidth.copies(True, True, wide) if name.startswith("pallas_")], \
        "a block wider than the array is no copy"
    kernels = {(r["kernel"], r["mode"], r["dtype"], str(r["shape"])) for r in rows if "kernel" in r}
    assert kernels == {(f"causal_conv1d_{k}", m, "bfloat16", str(full)) for k in ("silu", "plain") for m in ("fwd", "bwd")}
    for dtype, shape in arrays:
        fractions = [r["frac_best_copy"] for r in rows if (r["dtype"], r["shape"]) == (dtype, shape) and "copy" in r]
        assert max(fractions) == 1.0 and min(fractions) > 0
    for r in rows:
        assert r["bytes_per_s"] == pytest.approx(r["bytes"] / r["median_s"])
        assert r["frac_spec"] is None and r["spec_bytes_per_s"] is None  # no TPU here: no specification
        for key in ("device", "jax", "commit", "time_utc"):
            assert key in r, key
