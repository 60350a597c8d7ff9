"""Probe: the mixed step's kernel alone at several (tokens, channels) per grid step, at the serving benchmark's shapes.

    python -m benchmarks.probes.tpu_mixed_tiles              # on a TPU
    python -m benchmarks.probes.tpu_mixed_tiles --interpret  # anywhere (tiny shapes; checks it runs)
    python -m benchmarks.probes.tpu_mixed_tiles --parts      # where a grid step's time goes
    python -m benchmarks.probes.tpu_mixed_tiles --parts --chunk 512  # prefill chunks of 512 tokens
    python -m benchmarks.probes.tpu_mixed_tiles --parts --tile 64x2048  # the parts at other tiles
    python -m benchmarks.probes.tpu_mixed_tiles --parts --frame  # with Config(step_states_from_frame=True)
    python -m benchmarks.probes.tpu_mixed_tiles --configs 32x8192 32x8192+frame  # only those configs
    python -m benchmarks.probes.tpu_mixed_tiles --prefix     # where a prefix step's extra time goes

``bench serving --preset tpu``'s ``mixed`` steps (bfloat16 tokens, float32 states, W = 4,
SiLU; an eighth of the requests a 64-token prefill chunk, the others a decode token each),
each run 50 times a call with the pool carried in place (``bench.serving.in_place``), through
``pallas_mosaic_tpu.step`` with ``Config(step_tokens=..., step_channels=...)``: one JSON
line per shape and config with the time per step and the fraction of the step's bytes'
roofline at 820 GB/s, beside the composition (``implementation="xla"``: the TPU's path
before the kernel). Outputs and written states are checked against the composition's.

``--parts``: where a grid step's time goes, at the default tiles: the kernel timed whole,
without its slot selections (each tap and state row takes the frame's rows), without its
slot DMAs (no copy starts or waits), and without both; without the state rows (each
token's would-be state stored and each slot's inputs loaded one sublane a token), with and
without the slot DMAs. The variants' values are wrong by construction and not checked,
only their times are the finding.

``--prefix``: ``bench serving``'s ``prefix`` steps (the ``mixed`` steps' tokens, each
prefill chunk's state after every 16 tokens written to a slot of its own) at the default
``Config``: the kernel on the mixed step (as it is, and with its bookkeeping's scatters:
``COMPARE_PAIRS = 0``) and on the prefix step with its block states, and
``causal_conv1d_step`` on the prefix step (the kernel behind its race check and run-time
branch): as it is (compares at these sizes), with scatters, and with the check replaced
by a traced ``False`` (the branch alone); each time a step the difference of loops of 100
and 50 steps over 50 (the call's own cost left out).

``--chunk N``: the prefill requests' chunks are N tokens (64 in the preset), so that most
tiles lie inside a long prefill, where no token reads its slot. ``--tile TxC``: the parts
at T tokens and C channels a grid step (the default ``Config``'s otherwise).
"""
import contextlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from maskconv_kernels.bench.serving import PRESETS, _shape, ideal_bytes, in_place, make_step, ours
from maskconv_kernels.bench.timing import median_times
from maskconv_kernels.ops.causal_conv1d import pallas_mosaic_tpu as tpu
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import config as tpu_config
from maskconv_kernels.ops.causal_conv1d.pallas_mosaic_tpu import mixed
from maskconv_kernels.ops.causal_conv1d.checks import problem_of
from maskconv_kernels.ops.causal_conv1d import step as step_module
from maskconv_kernels.ops.causal_conv1d.step import _crossings, _owners
from maskconv_kernels.ops.causal_conv1d.update import slot_codes

INTERPRET = "--interpret" in sys.argv or jax.default_backend() != "tpu"
CHUNK = int(sys.argv[sys.argv.index("--chunk") + 1]) if "--chunk" in sys.argv else None
SHAPES = (_shape(8, 256, chunk=CHUNK or 20),) if INTERPRET else tuple(
    _shape(s.rows, s.dim, s.width, CHUNK or s.chunk, s.block) for s in PRESETS["tpu"][1])
# (128, 1024), (256, 1024) and (256, 512) ran within 5% of (64, 1024) or behind it on the
# v5e (benchmarks/results/causal_conv1d_tpu_mixed_tiles_tpu_v5e_jax0.10.jsonl); the wide
# blocks make fewer slot DMAs (one a request each way per channel block). On 2026-12-07 32 x
# 8,192 (the default since) beat 64 x 1,024 by 9-16% at all four shapes, 128 x 2,048 and
# 64 x 4,096 in between (benchmarks/results/tpu-check-2026-12-07e/mixed_tiles.jsonl).
# A third element True: Config(step_states_from_frame=True) (ending long requests' states
# copied from the frame, not stored for every token).
CONFIGS = ((16, 128), (16, 128, True), (32, 256)) if INTERPRET else (
    (32, 8192), (32, 8192, True), (16, 8192), (64, 4096))
if "--configs" in sys.argv:  # e.g. --configs 32x8192 32x8192+frame: only those
    CONFIGS = tuple(c for c in CONFIGS if f"{c[0]}x{c[1]}" + ("+frame" if c[2:] else "") in sys.argv)
FRAME = "--frame" in sys.argv
STEPS = 2 if INTERPRET else 50


def _from_frame(config) -> bool:
    """Whether ``config`` (tokens, channels[, True]) takes ending requests' states from the frame."""
    return config[2:] == (True,)


def _name(config) -> str:
    return f"{config[0]}x{config[1]}" + ("+frame" if _from_frame(config) else "")


def kernel(config, block=None):
    """``f(step)``: the mixed step's kernel at ``config``; with ``block`` (``K``), the step's
    block states too (``step.block_indices``, ``step.num_computed_tokens``)."""
    def f(s):
        fresh = jnp.logical_not(s.has_initial_state)
        blocks = None
        if block is not None:
            crossed = _crossings(s.query_start_loc, s.state_indices, block, s.block_indices, s.num_computed_tokens)[1]
            blocks = (block, crossed, s.num_computed_tokens.astype(jnp.int32))
        reads, writes = slot_codes(s.state_indices, s.state_indices, fresh, s.pool.shape[0])
        owner = _owners(s.query_start_loc, s.x.shape[0])
        within = jnp.arange(s.x.shape[0], dtype=jnp.int32) - jnp.take(s.query_start_loc, owner)
        problem = problem_of(s.x[None], s.weight, s.bias, None, s.pool, activation="silu", dilation=1)
        return tuple(tpu.step(s.x, s.pool, s.weight, s.bias, s.query_start_loc, reads, writes, owner,
                              within.astype(jnp.int32), problem=problem, config=tpu.Config(
                                  step_tokens=config[0], step_channels=config[1],
                                  step_states_from_frame=_from_frame(config)), interpret=INTERPRET,
                              blocks=blocks))
    return f


class _NoCopy:
    def start(self):
        pass

    def wait(self):
        pass


_NO_ROWS = {"_store_state_row": lambda *_: None, "_load_slot_inputs": lambda *_: None}
VARIANTS = {
    "whole": {},
    "no selections": {"_chosen": lambda frame_rows, *_: frame_rows},
    "no slot DMAs": {"_slot_copy": lambda *_, **__: _NoCopy()},
    "neither": {"_chosen": lambda frame_rows, *_: frame_rows, "_slot_copy": lambda *_, **__: _NoCopy()},
    "no state rows": _NO_ROWS,
    "no state rows, no slot DMAs": {**_NO_ROWS, "_slot_copy": lambda *_, **__: _NoCopy()},
}


@contextlib.contextmanager
def patched(names: dict, module=mixed):
    """``module``'s globals replaced by ``names`` (and ``mixed``'s built calls forgotten) while inside."""
    saved = {name: getattr(module, name) for name in names}
    mixed._call.cache_clear()
    try:
        for name, fn in names.items():
            setattr(module, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
        mixed._call.cache_clear()


def _never_refused(qsl, *_, **__):
    """The race check replaced by a traced ``False``: the run-time branch stays, its cost alone."""
    return qsl[0] < 0


def parts():
    config = (tpu.Config().step_tokens, tpu.Config().step_channels)
    if "--tile" in sys.argv:
        config = tuple(int(n) for n in sys.argv[sys.argv.index("--tile") + 1].split("x"))
    config += (True,) if FRAME else ()
    for shape in SHAPES:
        step = make_step(shape, "mixed", jnp.bfloat16)
        fns = {}
        for name, names in VARIANTS.items():
            with patched(names):
                fns[name] = jax.jit(in_place(kernel(config), STEPS)).lower(step).compile()
        grid_steps = -(-int(step.x.shape[0]) // config[0]) * (shape.dim // min(shape.dim, config[1]))
        for name, t in median_times(fns, [(step,)], 5 if INTERPRET else 10).items():
            print(json.dumps(dict(shape=shape.name, chunk=shape.chunk, tile=config[0], channels=config[1], frame=FRAME,
                                  variant=name,
                                  median_s=t / STEPS, per_grid_step_s=t / STEPS / grid_steps)), flush=True)


def prefix():
    config = (tpu.Config().step_tokens, tpu.Config().step_channels, tpu.Config().step_states_from_frame)
    for shape in SHAPES:
        mixed_step, prefix_step = make_step(shape, "mixed", jnp.bfloat16), make_step(shape, "prefix", jnp.bfloat16)
        scatters = ({"COMPARE_PAIRS": 0}, tpu_config)  # patched()'s arguments
        variants = {"kernel, mixed step": (kernel(config), mixed_step, None),
                    "kernel, mixed step, scatters": (kernel(config), mixed_step, scatters),
                    "kernel, prefix step, block states": (kernel(config, shape.block), prefix_step, None),
                    "causal_conv1d_step, prefix step": (ours(shape, "prefix"), prefix_step, None),
                    "causal_conv1d_step, prefix step, scatters": (ours(shape, "prefix"), prefix_step, scatters),
                    "causal_conv1d_step, prefix step, no race check": (
                        ours(shape, "prefix"), prefix_step, ({"_kernels_refuse": _never_refused}, step_module))}
        fns, args = {}, {}
        for name, (f, step, patch) in variants.items():
            for n in (STEPS, 2 * STEPS):
                with patched(*(patch or ({},))):
                    fns[name, n] = jax.jit(in_place(f, n)).lower(step).compile()
                args[name, n] = [(step,)]
        times = median_times(fns, args, 5 if INTERPRET else 10)
        for name in variants:
            per_step = (times[name, 2 * STEPS] - times[name, STEPS]) / STEPS
            print(json.dumps(dict(shape=shape.name, chunk=shape.chunk, block=shape.block, variant=name,
                                  median_s=per_step, call_s=times[name, STEPS] - STEPS * per_step)), flush=True)


def main():
    if "--parts" in sys.argv:
        return parts()
    if "--prefix" in sys.argv:
        return prefix()
    for shape in SHAPES:
        step = make_step(shape, "mixed", jnp.bfloat16)
        roofline = ideal_bytes(shape, "mixed", jnp.bfloat16, step.pool.dtype) / 820e9
        ref_y, ref_pool = jax.jit(ours(shape, "mixed", "xla"))(step)
        fns = {"composition": jax.jit(in_place(ours(shape, "mixed", "xla"), STEPS))}
        for config in CONFIGS:
            row = dict(shape=shape.name, tokens=int(step.x.shape[0]), tile=config[0], channels=config[1],
                       states_from_frame=_from_frame(config))
            try:
                y, pool = jax.jit(kernel(config))(step)
                row.update(max_abs_diff=float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref_y.astype(jnp.float32)))),
                           states_equal=bool(np.array_equal(np.asarray(pool[step.state_indices]),
                                                            np.asarray(ref_pool[step.state_indices]))))
                fns[_name(config)] = jax.jit(in_place(kernel(config), STEPS))
            except Exception as e:  # noqa: BLE001 - a refused config is the finding
                row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            print(json.dumps(row), flush=True)
        times = median_times(fns, [(step,)], 5 if INTERPRET else 10)
        for name, t in times.items():
            per_step = t / STEPS
            print(json.dumps(dict(shape=shape.name, config=name, median_s=per_step, roofline_s=roofline,
                                  frac_roofline=roofline / per_step)), flush=True)


if __name__ == "__main__":
    main()
