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
    copies = {(r["copy"], r["dtype"]) for r in rows if "copy" in r}
    assert copies == {(name, dtype) for name in tpu_bandwidth.copies(True, True) for dtype in ("bfloat16", "float32")}
    kernels = {(r["kernel"], r["mode"]) for r in rows if "kernel" in r}
    assert kernels == {(f"causal_conv1d_{k}", m) for k in ("silu", "plain") for m in ("fwd", "bwd")}
    for dtype in ("bfloat16", "float32"):
        fractions = [r["frac_best_copy"] for r in rows if r["dtype"] == dtype and "copy" in r]
        assert max(fractions) == 1.0 and min(fractions) > 0
    for r in rows:
        assert r["bytes_per_s"] == pytest.approx(r["bytes"] / r["median_s"])
        assert r["frac_spec"] is None and r["spec_bytes_per_s"] is None  # no TPU here: no specification
        for key in ("device", "jax", "commit", "time_utc"):
            assert key in r, key
