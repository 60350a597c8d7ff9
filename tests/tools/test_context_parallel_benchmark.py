"""benchmarks/context_parallel.py: bytes each device receives per layer call, read from the compiled programs."""
import json

import jax
import pytest
from support.mesh import needs_mesh

from benchmarks import context_parallel


@pytest.mark.slow  # a tool's run; the fast tier checks the no-all-gather HLO itself
@needs_mesh
def test_the_quick_run_counts_the_halo_and_the_gathered_bytes(tmp_path):
    assert context_parallel.main(["--quick", "--samples", "2", "--out", str(tmp_path / "cp")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "cp.jsonl").read_text().splitlines()]
    devices = jax.device_count()
    by = {(r["layer"], r["how"]): r for r in rows}
    # The short conv (2 rows, D = 64, W = 4, float32): a halo of 3 positions per chunk, by permutes alone.
    layer = "mamba2_B2_L512_D64_W4"
    assert by[layer, "contiguous"]["by_collective"] == {"collective-permute": 3 * 64 * 2 * 4, "all-gather": 0}
    assert by[layer, "zigzag"]["received_bytes"] == 2 * 3 * 64 * 2 * 4
    assert by[layer, "all_gather"]["by_collective"]["all-gather"] == 2 * 512 * 64 * 4 * (devices - 1) // devices
    # The video layer (8x8 frames of 8 channels, k_T = 3): 2 frames before each chunk.
    assert by["video_vae_T32_8x8_C8_k3", "contiguous"]["received_bytes"] == 2 * 8 * 8 * 8 * 4
    assert all(r["median_s"] > 0 and r["device"] for r in rows)
    assert "| mamba2_B2_L512_D64_W4 | zigzag | 3,072 |" in (tmp_path / "cp.md").read_text()


def test_it_refuses_one_device(monkeypatch, capsys):
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    assert context_parallel.main(["--quick"]) == 2
    assert "xla_force_host_platform_device_count" in capsys.readouterr().err
