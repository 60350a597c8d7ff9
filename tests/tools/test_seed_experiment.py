"""The original report's experiments, verbatim (benchmarks/seed_experiment.py): masked_conv reads no masked tap."""
import json

import numpy as np

from benchmarks import seed_experiment


def test_the_seed_experiment_runs_and_masked_conv_is_exact(tmp_path, capsys):
    assert seed_experiment.main(["--json", str(tmp_path / "seed.json")]) == 0
    found = json.loads((tmp_path / "seed.json").read_text())["experiments"]
    assert set(found) == {f"{c}, {m}" for c in ("lax.conv(kernel*mask)", "masked_conv") for m in ("eager", "jit")}
    for label, r in found.items():
        grad, out = np.array(r["grad_map"]), np.array(r["out_map"])
        assert grad.shape == out.shape == (5, 5)
        assert (grad[1:3, 1:4] > 0.1).all()  # the centre's active field, as in the report
        assert (out[3:] > 0.1).all() and (out[:2] == 0).all()
        if label.startswith("masked_conv"):
            assert r["grad_row3_max_abs"] == 0.0 == r["out_row2_max_abs"]
    assert "| masked_conv, jit | 0 | 0 |" in capsys.readouterr().out
