"""The serving benchmark (maskconv_kernels.bench serving): its baseline computes the step, its rows carry their metadata."""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from support.numerics import assert_close, tolerance

from maskconv_kernels.bench import serving
from maskconv_kernels.bench.__main__ import main


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_the_baseline_computes_what_the_step_computes(kind):
    """gather + lax.conv + scatter: the same outputs and written slots as causal_conv1d_step, the rest of the pool kept."""
    _, (shape,) = serving.PRESETS["quick"]
    step = serving.make_step(shape, kind, np.float32)
    y, pool = jax.jit(serving.ours(shape, kind))(step)
    y_ref, pool_ref = jax.jit(serving.baseline(shape, kind))(step)
    scale = float(np.abs(np.asarray(step.x)).max() * np.abs(np.asarray(step.weight)).max() + 1)
    assert_close(y, y_ref, np.float32, shape.width, scale)
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(pool_ref))  # copies of inputs: exact
    unwritten = np.setdiff1d(np.arange(pool.shape[0]), np.asarray(step.state_indices))
    np.testing.assert_array_equal(np.asarray(pool)[unwritten], np.asarray(step.pool)[unwritten])


def test_the_ideal_bytes_count_each_read_and_write_once():
    shape = serving.StepShape("s", rows=16, dim=8, width=4, chunk=8, block=4)
    state, token, weights = 3 * 8 * 4, 8 * 2, 5 * 8 * 4  # float32 states, bfloat16 tokens, float32 weights
    assert serving.ideal_bytes(shape, "decode", np.dtype("bfloat16"), np.float32) == 32 * state + 32 * token + weights
    # Two prefill chunks of 8 (fresh: their slots not read), 14 decode rows; with caching, 2 blocks each.
    mixed = (14 + 16) * state + 2 * (2 * 8 + 14) * token + weights
    assert serving.ideal_bytes(shape, "mixed", np.dtype("bfloat16"), np.float32) == mixed
    assert serving.ideal_bytes(shape, "prefix", np.dtype("bfloat16"), np.float32) == mixed + 4 * state
    # Speculative decoding: 14 decode rows of 1 + 3 tokens, windows of 3 inputs read, slots of 6 written.
    slot = 6 * 8 * 4
    drafts = 14 * state + 16 * slot + 2 * (2 * 8 + 14 * 4) * token + weights
    assert serving.ideal_bytes(shape, "drafts", np.dtype("bfloat16"), np.float32) == drafts


def test_a_quick_run_times_every_kind_with_metadata(tmp_path, capsys):
    assert main(["serving", "--preset", "quick", "--no-chart", "--out", str(tmp_path), "--name", "q"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert {(r["kind"], r["implementation"]) for r in rows} == {
        ("decode", serving.OURS), ("decode", serving.BASELINE), ("mixed", serving.OURS), ("mixed", serving.BASELINE),
        ("prefix", serving.OURS), ("prefix", serving.COMPOSED), ("documents", serving.OURS),
        ("documents", serving.COMPOSED), ("drafts", serving.OURS), ("drafts", serving.COMPOSED)}
    for r in rows:
        assert "error" not in r, r["error"]
        for key in ("device", "jax", "commit", "time_utc", "median_s", "roofline_s", "ideal_bytes", "state_dtype"):
            assert key in r, key
        assert r["p20_s"] <= r["median_s"] <= r["p80_s"] and 0 < r["frac_roofline"]
        assert r["nan_isolated"]  # NaN in every slot the step does not read reaches nothing
    # The baseline's lax.conv runs at the precision in force (bfloat16 passes on a TPU); a sum
    # of W products of standard normal inputs (max ~4) and weights (max ~2).
    bound = tolerance(np.float32, 4) * 8
    assert all(r.get("max_abs_diff_vs_baseline", r.get("max_abs_diff_vs_composition")) < bound for r in rows
               if r["implementation"] == serving.OURS)
    printed = capsys.readouterr().out
    assert "| R8_D16_W4 | prefix |" in printed
    # The committed format renders back through the command line, as this mode's.
    assert main(["render", str(tmp_path / "q.jsonl"), "--out", str(tmp_path / "again"), "--no-chart"]) == 0
    assert "| R8_D16_W4 | decode |" in (tmp_path / "again" / "q.md").read_text()


def test_steps_per_call_times_steps_in_place_and_checks_one(tmp_path):
    """``--steps-per-call``: each call runs the steps in a loop carrying the pool; the rows say so,
    and their checks (one step) hold as in a run of one step a call."""
    assert main(["serving", "--preset", "quick", "--modes", "decode", "--no-chart", "--out", str(tmp_path),
                 "--name", "q", "--steps-per-call", "3"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert {r["implementation"] for r in rows} == {serving.OURS, serving.BASELINE}
    for r in rows:
        assert r["steps_per_call"] == 3 and r["nan_isolated"] and r["median_s"] > 0


def test_in_place_runs_the_steps_one_after_another():
    """Three steps of one token a request: the loop's pool is the pool after three single steps."""
    _, (shape,) = serving.PRESETS["quick"]
    step = serving.make_step(shape, "decode", np.float32)
    f = serving.ours(shape, "decode")
    pool = step.pool
    for _ in range(3):
        y, pool = jax.jit(f)(dataclasses.replace(step, pool=pool))
    y3, pool3 = jax.jit(serving.in_place(f, 3))(step)
    np.testing.assert_array_equal(np.asarray(pool3), np.asarray(pool))
    np.testing.assert_array_equal(np.asarray(y3), np.asarray(y))



def test_a_marginal_run_times_loops_of_n_and_2n_steps_and_gives_the_calls_own_cost(tmp_path, monkeypatch):
    """``--steps-per-call N --marginal``: each implementation's two loops (N and 2N steps) are
    timed side by side, a step's time is their difference over N (sample by sample), and the
    N-step call's time less N such steps is reported as ``call_s``."""
    seen = {}

    def fake(fns, argsets, preset):  # a call of n steps takes 1 ms + n * 0.1 ms, exactly
        seen.update(fns)
        return {name: [1e-3 + (2 if name.endswith(serving.DOUBLED) else 1) * 3 * 1e-4] * 3 for name in fns}

    monkeypatch.setattr(serving, "time_interleaved", fake)
    _, (shape,) = serving.PRESETS["quick"]
    preset, _ = serving.PRESETS["quick"]
    rows = serving.run_cell(shape, "float32", "mixed", preset, {}, 1e9, steps_per_call=3, marginal=True)
    assert set(seen) == {serving.OURS, serving.BASELINE, serving.OURS + serving.DOUBLED,
                         serving.BASELINE + serving.DOUBLED}
    for r in rows:
        assert r["timing"] == "marginal"
        assert r["median_s"] == pytest.approx(1e-4) and r["call_s"] == pytest.approx(1e-3)
    assert {r["implementation"] for r in rows} == {serving.OURS, serving.BASELINE}


def test_a_documents_step_packs_two_documents_in_each_prefill_chunk():
    """The ``documents`` kind: positions restart at the middle of each prefill chunk (two
    documents), decode tokens continue theirs; its outputs differ from the same step
    without positions exactly at the second documents' tokens that would read the first's."""
    _, (shape,) = serving.PRESETS["quick"]
    step = serving.make_step(shape, "documents", np.float32)
    qsl, positions = np.asarray(step.query_start_loc), np.asarray(step.positions)
    lengths = np.diff(qsl)
    for r, n in enumerate(lengths):
        pos = positions[qsl[r]:qsl[r + 1]]
        expected = [5] if n == 1 else list(range(n // 2)) + list(range(n - n // 2))
        np.testing.assert_array_equal(pos, expected)
    y, _ = jax.jit(serving.ours(shape, "documents", "xla"))(step)
    plain, _ = jax.jit(serving.ours(shape, "mixed", "xla"))(dataclasses.replace(step, positions=None))
    differs = np.any(np.asarray(y) != np.asarray(plain), axis=1)
    within = np.arange(qsl[-1]) - np.repeat(qsl[:-1], lengths)
    half = np.repeat(lengths // 2, lengths)
    reads_first = (np.repeat(lengths, lengths) > 1) & (within >= half) & (within - half < shape.width - 1)
    np.testing.assert_array_equal(differs, reads_first)


def test_a_drafts_step_probes_the_rejected_drafts_with_nan():
    """The ``drafts`` kind: decode rows of ``1 + DRAFTS`` tokens over slots of ``W - 1 +
    DRAFTS`` inputs, prefill chunks fresh with every token accepted; its NaN probe fills the
    read slots' rejected drafts (and only those) and every unread slot, and the step's
    outputs and states do not change."""
    _, (shape,) = serving.PRESETS["quick"]
    step = serving.make_step(shape, "drafts", np.float32)
    k, w = serving.DRAFTS, shape.width
    assert step.pool.shape[1] == w - 1 + k
    lengths, accepted = np.diff(np.asarray(step.query_start_loc)), np.asarray(step.num_accepted_tokens)
    decoding = np.arange(shape.rows) >= shape.prefills("drafts")
    np.testing.assert_array_equal(lengths[decoding], 1 + k)
    assert (accepted[~decoding] == k + 1).all() and 1 <= accepted.min() and accepted.max() <= k + 1
    probe = np.asarray(serving._unread_slots_nan(step).pool)
    for r in np.flatnonzero(decoding):
        rows = np.isnan(probe[int(step.state_indices[r])]).any(axis=1)
        np.testing.assert_array_equal(rows, np.arange(w - 1 + k) >= w - 2 + accepted[r])
    f = jax.jit(serving.ours(shape, "drafts", "xla"))
    (y, pool), (y_nan, pool_nan) = f(step), f(serving._unread_slots_nan(step))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_nan))
    written = np.asarray(step.state_indices)
    np.testing.assert_array_equal(np.asarray(pool)[written], np.asarray(pool_nan)[written])
