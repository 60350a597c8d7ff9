"""A serving scheduler's step: ``causal_conv1d_step`` against the bytes it must move and against what users write today.

    python -m maskconv_kernels.bench serving --preset cpu --out DIR

A step runs ``R`` requests over a pool of ``2R`` slots (float32 states, bfloat16
tokens, width 4, SiLU, as hybrid models serve their short convolutions). Five kinds:

* ``decode``: every request one token;
* ``mixed``: an eighth of the requests a new request's first prefill chunk of
  ``chunk`` tokens (its slot not read), the rest decode tokens (continuous batching);
* ``prefix``: ``mixed`` with prefix caching on (the state after every ``block`` tokens
  of a request written to a slot of its own), to set beside ``mixed`` (caching off);
* ``documents``: ``mixed`` with ``positions``, each prefill chunk two packed documents
  (the second starting at its middle), the decode tokens continuing theirs;
* ``drafts``: ``mixed`` under speculative decoding: each decode row carries its last
  accepted token and :data:`DRAFTS` drafts, after a step that accepted a random 1 to
  ``DRAFTS + 1`` of its tokens (``num_accepted_tokens``; slots of ``W - 1 + DRAFTS``
  inputs, the rejected drafts in them never read).

Timed in one process with samples interleaved (:mod:`.timing`), not donated (each
timed call reuses its inputs; ``--steps-per-call N`` runs N steps a call in a loop that
carries the pool in place instead, and gives the time per step; with ``--marginal`` a
step's time is the difference between calls of 2N and of N steps over N, which leaves out
the call's own cost, its dispatch and the pool's copy into the loop, given beside it):

* ``causal_conv1d_step``: this library, ``implementation=None``;
* ``gather+lax.conv+scatter`` (``decode`` and ``mixed``): the code users write today:
  gather each request's slot, place its tokens after it in a dense ``(R, W - 1 + n_max,
  D)`` block, ``lax.conv_general_dilated`` depthwise with ``VALID`` padding, take the
  outputs back to the step's token order and scatter each request's last ``W - 1``
  inputs to its slot;
* ``causal_conv1d_step, xla`` (``prefix``, ``documents``, ``drafts``): the same step as XLA's
  composition (gather, ``causal_conv1d`` over the step, scatter of states and block
  states), what TPUs ran for these steps before the mixed step's kernel took them.

Beside each time, the memory roofline: the bytes the step must move (each request's
window read and its state written, its tokens read and outputs written, each block state
written, the weights once) over the memory bandwidth (an H200's HBM on a GPU; on a CPU,
a large array add measured in the same run), and the fraction of it achieved. Each cell
also checks its executables: the largest difference of the outputs and written states
from the baseline's, and whether NaN in every slot the step does not read (and in every
rejected draft of the slots it reads) leaves every output and written state bit-identical.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..ops.causal_conv1d import causal_conv1d_step
from .chart import publish, roofline_bars
from .exactness import differences
from .machine import header, metadata
from .sequence import roofline_bandwidth
from .table import ms
from .timing import DTYPES, Preset, add_grid_arguments, memory, quantile, run_grid, select, time_interleaved

KINDS = ("decode", "mixed", "prefix", "documents", "drafts")
_COMPOSED_ONLY = ("prefix", "documents", "drafts")  # no dense baseline is written for these: the composition instead
OURS, BASELINE = "causal_conv1d_step", "gather+lax.conv+scatter"
COMPOSED = "causal_conv1d_step, xla"  # XLA's composition (the TPUs' path before the mixed kernel)
DRAFTS = 3  # the ``drafts`` kind's drafts a decode row carries


@dataclasses.dataclass(frozen=True)
class StepShape:
    """``R`` requests of one step, ``D`` channels, width ``W``; prefill chunks of ``chunk`` tokens."""

    name: str
    rows: int
    dim: int
    width: int
    chunk: int
    block: int  # the prefix cache's block size (the ``prefix`` kind)

    def prefills(self, kind: str) -> int:
        return 0 if kind == "decode" else max(1, self.rows // 8)

    def lengths(self, kind: str) -> np.ndarray:
        """Tokens per request: the prefill chunks first, then one token each (``1 + DRAFTS``
        in the ``drafts`` kind)."""
        p = self.prefills(kind)
        return np.array([self.chunk] * p + [1 + DRAFTS * (kind == "drafts")] * (self.rows - p), np.int32)

    def state_len(self, kind: str) -> int:
        """The inputs a slot holds: ``W - 1``, and the drafts' in the ``drafts`` kind."""
        return self.width - 1 + DRAFTS * (kind == "drafts")


def _shape(rows, dim, width=4, chunk=64, block=16):
    return StepShape(f"R{rows}_D{dim}_W{width}", rows, dim, width, chunk, block)


PRESETS = {
    "cpu": (Preset(False, ("bfloat16",), KINDS, samples=7, min_sample_s=0.05, warmup=1, max_input_sets=1, peak_n=0),
            (_shape(64, 2048), _shape(256, 2048))),
    "gpu": (Preset(True, ("bfloat16",), KINDS, samples=15, min_sample_s=0.002, warmup=2, max_input_sets=1, peak_n=0),
            (_shape(64, 2048), _shape(256, 2048), _shape(64, 8192), _shape(256, 8192))),
    # The GPU preset's shapes on a TPU v5e.
    "tpu": (Preset(True, ("bfloat16",), KINDS, samples=10, min_sample_s=0.002, warmup=2, max_input_sets=1, peak_n=0),
            (_shape(64, 2048), _shape(256, 2048), _shape(64, 8192), _shape(256, 8192))),
    # A smoke test (CI, tests): tiny, float32.
    "quick": (Preset(False, ("float32",), KINDS, samples=2, min_sample_s=0.0, warmup=1, max_input_sets=1, peak_n=0),
              (_shape(8, 16, chunk=6, block=4),)),
}


_STEP_FIELDS = ["x", "pool", "weight", "bias", "query_start_loc", "state_indices", "has_initial_state",
                "block_indices", "num_computed_tokens", "positions", "num_accepted_tokens"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_STEP_FIELDS, meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Step:
    """One step's arrays: ``x (T, D)``, ``pool (2R, W - 1, D)`` and the scheduler's metadata (a pytree)."""

    x: jax.Array
    pool: jax.Array
    weight: jax.Array
    bias: jax.Array
    query_start_loc: jax.Array
    state_indices: jax.Array
    has_initial_state: jax.Array  # prefill chunks start fresh: their slots are not read
    block_indices: jax.Array | None
    num_computed_tokens: jax.Array | None
    positions: jax.Array | None = None  # the ``documents`` kind: each token's position in its document
    num_accepted_tokens: jax.Array | None = None  # the ``drafts`` kind: of each row's previous step's tokens


def make_step(shape: StepShape, kind: str, dtype, seed: int = 0) -> Step:
    """A step of ``kind``: slots a random half of the pool, the others left for NaN probes."""
    rng = np.random.default_rng(seed)
    lengths = shape.lengths(kind)
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    slots = rng.permutation(2 * shape.rows)[: shape.rows].astype(np.int32)
    x = rng.standard_normal((int(qsl[-1]), shape.dim)).astype(np.float32)
    pool = rng.standard_normal((2 * shape.rows, shape.state_len(kind), shape.dim)).astype(np.float32)
    weight = (rng.standard_normal((shape.width, shape.dim)) / np.sqrt(shape.width)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(shape.dim)).astype(np.float32)
    blocks = computed = None
    if kind == "prefix":
        # Prefill chunks start at token 0 of their request and cache every block they fill;
        # their block slots are the pool's unread ones (a decode row crosses no boundary here).
        per_row = shape.chunk // shape.block
        free = np.setdiff1d(np.arange(2 * shape.rows), slots)
        blocks = np.full((shape.rows, per_row), -1, np.int32)
        p = shape.prefills(kind)
        blocks[:p] = free[: p * per_row].reshape(p, per_row)
        computed = np.where(lengths > 1, 0, 5).astype(np.int32)  # decode rows: 5 tokens in, no boundary at 6
    positions = None
    if kind == "documents":  # prefill chunks: two documents each, the second from the middle; decode: position 5
        within = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], lengths)
        half = np.repeat(lengths // 2, lengths)
        positions = np.where(np.repeat(lengths, lengths) > 1, np.where(within >= half, within - half, within), 5)
    accepted = None
    if kind == "drafts":  # prefill chunks: every token accepted (a fresh slot); decode rows: 1 to DRAFTS + 1
        accepted = np.where(np.arange(shape.rows) < shape.prefills(kind), DRAFTS + 1,
                            rng.integers(1, DRAFTS + 2, size=shape.rows)).astype(np.int32)
    as_x = lambda a: jnp.asarray(a).astype(dtype)  # noqa: E731
    return Step(as_x(x), jnp.asarray(pool), jnp.asarray(weight), jnp.asarray(bias), jnp.asarray(qsl),
                jnp.asarray(slots), jnp.asarray(np.arange(shape.rows) >= shape.prefills(kind)),
                None if blocks is None else jnp.asarray(blocks), None if computed is None else jnp.asarray(computed),
                None if positions is None else jnp.asarray(positions, jnp.int32),
                None if accepted is None else jnp.asarray(accepted))


def ours(shape: StepShape, kind: str, implementation: str | None = None):
    """``f(step) -> (y, pool)``: ``causal_conv1d_step`` (prefix caching in the ``prefix`` kind,
    ``positions`` in the ``documents`` kind, ``num_accepted_tokens`` in the ``drafts`` kind)."""
    caching = kind == "prefix"

    def f(s: Step):
        return causal_conv1d_step(
            s.x, s.pool, s.weight, s.bias, query_start_loc=s.query_start_loc, state_indices=s.state_indices,
            has_initial_state=s.has_initial_state, activation="silu", block_size=shape.block if caching else None,
            block_indices=s.block_indices if caching else None,
            num_computed_tokens=s.num_computed_tokens if caching else None, positions=s.positions,
            num_accepted_tokens=s.num_accepted_tokens, implementation=implementation,
        )

    return f


def baseline(shape: StepShape, kind: str):
    """``f(step) -> (y, pool)``: gather, a dense block per request, ``lax.conv``, scatter."""
    lengths = shape.lengths(kind)
    n_max, k = int(lengths.max()), shape.width - 1

    def f(s: Step):
        starts, n = s.query_start_loc[:-1], s.query_start_loc[1:] - s.query_start_loc[:-1]
        # Each request's tokens, padded to n_max: (R, n_max, D), positions past n read token 0 (unused).
        t = jnp.arange(n_max)
        index = jnp.where(t[None] < n[:, None], starts[:, None] + t[None], 0)
        tokens = s.x[index].astype(s.pool.dtype)
        past = jnp.where(s.has_initial_state[:, None, None], s.pool[s.state_indices], 0)
        window = jnp.concatenate([past, tokens], axis=1)  # (R, K + n_max, D)
        y = lax.conv_general_dilated(
            window, s.weight[:, None, :].astype(window.dtype), (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"),
            feature_group_count=shape.dim, preferred_element_type=jnp.float32,
        )
        y = jax.nn.silu(y + s.bias).astype(s.x.dtype)  # (R, n_max, D)
        # Back to the step's order: token i is row r's (i - start) output.
        row = jnp.searchsorted(s.query_start_loc, jnp.arange(s.x.shape[0]), side="right") - 1
        y = y[row, jnp.arange(s.x.shape[0]) - starts[row]]
        # The last K inputs of each request: window positions n .. n + K - 1.
        last = jnp.take_along_axis(window, (n[:, None] + jnp.arange(k)[None])[..., None], axis=1)
        return y, s.pool.at[s.state_indices].set(last)

    return f


def ideal_bytes(shape: StepShape, kind: str, x_dtype, state_dtype) -> int:
    """What the step must move: windows read and states written, tokens read and outputs written, block states
    written, the weights once. A window is ``W - 1`` inputs (of a slot's accepted ones), a state a whole slot."""
    window = (shape.width - 1) * shape.dim * np.dtype(state_dtype).itemsize
    state = shape.state_len(kind) * shape.dim * np.dtype(state_dtype).itemsize
    lengths = shape.lengths(kind)
    tokens = int(lengths.sum()) * shape.dim * np.dtype(x_dtype).itemsize
    read = shape.rows - shape.prefills(kind)  # prefill chunks start fresh
    blocks = shape.prefills(kind) * (shape.chunk // shape.block) if kind == "prefix" else 0
    return read * window + (shape.rows + blocks) * state + 2 * tokens + (shape.width + 1) * shape.dim * 4


def _unread_slots_nan(s: Step) -> Step:
    """The step with NaN in every pool slot it does not read (fresh requests' slots among them),
    and in the rejected drafts of those it reads (after each one's last accepted input)."""
    read = jnp.zeros(s.pool.shape[0], bool).at[s.state_indices].set(s.has_initial_state)
    kept = jnp.broadcast_to(read[:, None], s.pool.shape[:2])
    if s.num_accepted_tokens is not None:
        state_len = s.pool.shape[1]
        # A row that accepted a of its previous step's 1 + k tokens holds W - 2 + a valid inputs.
        rejected = jnp.zeros(s.pool.shape[0], jnp.int32).at[s.state_indices].set(
            s.weight.shape[0] - 2 + s.num_accepted_tokens)
        kept = kept & (jnp.arange(state_len)[None, :] < rejected[:, None])
    return dataclasses.replace(s, pool=jnp.where(kept[..., None], s.pool, jnp.nan))


def _written(s: Step, pool) -> jax.Array:
    """The slots the step writes: its requests' (the block slots are checked by the NaN probe)."""
    return pool[s.state_indices]


def in_place(f, steps: int):
    """``f(step) -> (y, pool)`` run ``steps`` times in one ``lax.fori_loop`` that carries the
    pool, as a server's loop does with a donated pool: the pool is updated in place (XLA
    copies it once, into the loop), so an implementation that aliases the pool is not
    charged a copy of it per step. The step's other arrays are the same each time."""
    def g(s: Step):
        def body(_, carry):
            return f(dataclasses.replace(s, pool=carry[1]))
        return lax.fori_loop(0, steps, body, (jnp.zeros(s.x.shape, s.x.dtype), s.pool))
    return g


DOUBLED = " (2N steps)"  # the timed loop of twice the steps, for a marginal time


def run_cell(shape: StepShape, dtype_name: str, kind: str, preset: Preset, meta: dict, bandwidth: float,
             steps_per_call: int = 1, marginal: bool = False) -> list[dict]:
    """One cell's rows. ``steps_per_call = N > 1``: each timed call runs N steps
    (:func:`in_place`), and the times are per step: a call's over N, or with ``marginal``
    the difference of a call of 2N steps and one of N (sampled side by side) over N, with
    the call's own cost (``call_s``: the N-step call's time less N steps) beside it. The
    checks run one step."""
    marginal = marginal and steps_per_call > 1
    dtype = DTYPES[dtype_name]
    step = make_step(shape, kind, dtype)
    found = {OURS: ours(shape, kind)}
    if kind not in _COMPOSED_ONLY:
        found[BASELINE] = baseline(shape, kind)
    else:
        found[COMPOSED] = ours(shape, kind, "xla")
    base = {"shape": shape.name, **dataclasses.asdict(shape), "kind": kind, "tokens": int(step.x.shape[0]),
            "dtype": dtype_name, "state_dtype": str(step.pool.dtype), "weight_dtype": "float32",
            "ideal_bytes": ideal_bytes(shape, kind, dtype, step.pool.dtype), "bandwidth_bytes_per_s": bandwidth,
            "steps_per_call": steps_per_call, "timing": "marginal" if marginal else "per call", **meta}
    rows, compiled, timed = {}, {}, {}
    for name, f in found.items():
        row = dict(base, implementation=name)
        try:
            t = time.perf_counter()
            compiled[name] = jax.jit(f).lower(step).compile()
            row["compile_s"] = time.perf_counter() - t
            row.update(memory(compiled[name]))
            timed[name] = (compiled[name] if steps_per_call == 1
                           else jax.jit(in_place(f, steps_per_call)).lower(step).compile())
            if marginal:
                timed[name + DOUBLED] = jax.jit(in_place(f, 2 * steps_per_call)).lower(step).compile()
        except Exception as e:  # report it and carry on with the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        rows[name] = row
    times = time_interleaved(timed, [(step,)], preset)
    roofline = base["ideal_bytes"] / bandwidth
    for name in rows:
        if name not in times:
            continue
        if marginal:  # paired samples: the same sample of each loop
            ts = [(t2 - t1) / steps_per_call for t1, t2 in zip(times[name], times[name + DOUBLED])]
            rows[name]["call_s"] = statistics.median(times[name]) - steps_per_call * statistics.median(ts)
        else:
            ts = [t / steps_per_call for t in times[name]]
        rows[name].update(median_s=statistics.median(ts), p20_s=quantile(ts, 0.2), p80_s=quantile(ts, 0.8),
                          roofline_s=roofline, frac_roofline=roofline / statistics.median(ts))
    if BASELINE in times:
        for name in set(times) & set(rows) - {BASELINE}:
            rows[name][f"vs_{BASELINE}"] = rows[BASELINE]["median_s"] / rows[name]["median_s"]
    probe = _unread_slots_nan(step)
    outputs = {name: c(step) for name, c in compiled.items()}
    for name, c in compiled.items():
        y, pool = outputs[name]
        y_nan, pool_nan = c(probe)
        rows[name]["nan_isolated"] = bool(
            np.array_equal(np.asarray(y), np.asarray(y_nan))
            and np.array_equal(np.asarray(_written(step, pool)), np.asarray(_written(step, pool_nan)))
        )
        for ref, key in ((BASELINE, "max_abs_diff_vs_baseline"), (COMPOSED, "max_abs_diff_vs_composition")):
            if name not in (BASELINE, COMPOSED) and ref in outputs:
                y_ref, pool_ref = outputs[ref]
                rows[name][key] = max(differences(y, y_ref)["max_abs_diff"],
                                      differences(_written(step, pool), _written(step, pool_ref))["max_abs_diff"])
    return list(rows.values())


# --------------------------------------------------------------------------- output


def markdown(rows: list[dict]) -> str:
    calls = [r["call_s"] for r in rows if "call_s" in r]
    marginal = (f" (the marginal time: a call of 2N steps less one of N, over N; a call's own cost, its dispatch "
                f"and the pool's copy into the loop, is left out: {ms(min(calls))}-{ms(max(calls))} ms a call)"
                if calls else "")
    lines = [
        f"Median ms (p20-p80) of one step{marginal}; roofline = the bytes the step must move / bandwidth (the fraction of it "
        f"achieved in brackets); vs baseline = {BASELINE}'s time over this row's; diff = the largest |difference| "
        "of outputs and written states from the baseline's; NaN-isolated = NaN in every slot the step does not read "
        f"leaves every output and written state bit-identical. Prefix, documents and drafts steps have no "
        f"baseline; {COMPOSED} is XLA's composition of the same step, and their diff is from it.",
        "",
        "| shape | kind | tokens | dtype / state | implementation | median ms | p20-p80 ms | roofline ms (achieved) "
        "| vs baseline | peak MiB | diff | NaN-isolated |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['kind']} | {r['tokens']} | {r['dtype']} / {r['state_dtype']} "
                         f"| {r['implementation']} | error: {r['error'][:80]} ||||||")
            continue
        if "median_s" not in r:
            continue
        vs = r.get(f"vs_{BASELINE}")
        peak = "—" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.0f}"
        diff = r.get("max_abs_diff_vs_baseline", r.get("max_abs_diff_vs_composition"))
        lines.append(
            f"| {r['shape']} | {r['kind']} | {r['tokens']} | {r['dtype']} / {r['state_dtype']} | {r['implementation']} "
            f"| {ms(r['median_s'])} | {ms(r['p20_s'])}-{ms(r['p80_s'])} | {ms(r['roofline_s'])} "
            f"({100 * r['frac_roofline']:.0f}%) | {'—' if vs is None else f'{vs:.2f}x'} | {peak} "
            f"| {'—' if diff is None else f'{diff:.3g}'} | {'yes' if r['nan_isolated'] else '**no**'} |"
        )
    return "\n".join(lines)


def chart(rows: list[dict], path: Path) -> None:
    roofline_bars(rows, path, "kind", "fraction of the memory roofline", "a serving step's short convolution")


def is_rows(rows: list[dict]) -> bool:
    """Whether ``rows`` (a ``.jsonl`` read back) are this benchmark's."""
    return bool(rows) and all("kind" in r and "ideal_bytes" in r for r in rows)


def write_outputs(rows: list[dict], out: Path | None, chart_too: bool) -> None:
    """Prints the table; with ``out``, also writes ``out.md`` and (``chart_too``) ``out.png``."""
    publish(header(rows) + "\n\n" + markdown(rows) + "\n", rows, out, chart_too, chart)


def add_arguments(parser) -> None:
    add_grid_arguments(parser, PRESETS, "cpu: 64 and 256 requests, D=2048, bfloat16 tokens, float32 states; gpu: "
                       "also D=8192; quick: one tiny float32 step", "a substring of shape names (R<rows>_D<dim>_W<width>)",
                       KINDS)
    parser.add_argument("--steps-per-call", type=int, default=1,
                        help="time this many steps per call in a loop carrying the pool (in place, as a donated "
                             "server loop; default 1: one step a call, the pool copied when an implementation "
                             "aliases it)")
    parser.add_argument("--marginal", action="store_true",
                        help="with --steps-per-call N > 1: a step's time is the difference of calls of 2N and N "
                             "steps over N, the call's own cost (dispatch, the pool's copy into the loop) left out "
                             "and reported beside it")


def run(args) -> int:
    """Times the grid; rows to ``args.prefix``.jsonl as they come, then the table and the chart."""
    platform_name = jax.default_backend()
    name, preset, shapes = select(args, PRESETS, platform_name)
    if not shapes:
        return 2
    out = args.prefix
    meta = metadata(name, args.command)
    bandwidth, measured = roofline_bandwidth(platform_name, preset)
    meta = {**meta, "measured_bandwidth_bytes_per_s": measured}
    grid = [(s, d, k) for s in shapes for d in preset.dtypes for k in preset.modes]
    steps = max(1, getattr(args, "steps_per_call", 1))
    marginal = bool(getattr(args, "marginal", False))
    rows = run_grid(grid, lambda _, *cell: run_cell(*cell, preset, meta, bandwidth, steps, marginal), out,
                    args.time_budget,
                    f"{meta['device']} (preset {name})")
    write_outputs(rows, out, chart_too=not args.no_chart)
    return 0 if rows and not any("error" in r for r in rows) else 1
