"""Mosaic GPU's interpreter under load: deep stacks in several processes at once, none hangs.

The interpreter simulates a GPU's threads with host callbacks that wait on each other. Run
as a nested computation inside a callback, it could wait forever on XLA:CPU's threads
(it hung in most runs of two processes on a 2-core machine); the primitives trace it
inline with its ordered effect instead (``maskconv_kernels._core.primitives``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

PROCESSES = 4
TIMEOUT_S = 900

# Each process: a 6-layer PixelCNN stack (7x7 type A, five 3x3 type B), its gradient at the
# centre pixel and the centre's value with every later pixel NaN, twice.
_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import maskconv_kernels as mk
    rng = np.random.default_rng(0)
    masks = [mk.pixelcnn_mask((7, 7), "A")] + [mk.pixelcnn_mask((3, 3), "B")] * 5
    kernels = [jnp.asarray(rng.standard_normal((*m.shape, 3 if i == 0 else 16, 16)) * 0.3, jnp.bfloat16)
               for i, m in enumerate(masks)]
    def net(x):
        for m, k in zip(masks, kernels):
            x = jnp.tanh(mk.masked_conv(x, k, m, implementation="pallas_mosaic_gpu", interpret=True))
        return x
    x = jnp.asarray(rng.standard_normal((1, 9, 9, 3)), jnp.bfloat16)
    future = np.arange(81).reshape(9, 9) >= 40
    for _ in range(2):
        g = np.asarray(jax.jit(jax.grad(lambda x: net(x)[0, 4, 4].astype(jnp.float32).sum()))(x), np.float32)[0]
        assert (g[future] == 0).all() and (g[~future] != 0).any()
        poisoned = np.array(x, np.float32)
        poisoned[0][future] = np.nan
        f = jax.jit(lambda x: net(x)[0, 4, 4])
        assert np.asarray(f(x)).tobytes() == np.asarray(f(jnp.asarray(poisoned, jnp.bfloat16))).tobytes()
    print("done")
""")


def _mosaic_runs_here() -> bool:
    import jax

    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


@pytest.mark.slow
@pytest.mark.skipif(not _mosaic_runs_here(), reason="Mosaic GPU's interpreter needs jax >= 0.11")
def test_interpreted_mosaic_deep_stacks_in_parallel_processes_all_finish():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(PROCESSES)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    hung, failed = 0, []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            hung += 1
            continue
        if p.returncode != 0 or "done" not in out:
            failed.append(err[-2000:])
    assert hung == 0, f"{hung} of {PROCESSES} processes did not finish in {TIMEOUT_S} s"
    assert not failed, failed[0]
