"""Random scheduler traces replayed through ``causal_conv1d_step``, each request against
``causal_conv1d`` on its whole sequence alone.

A simulated server runs requests through steps of a fixed size (``T`` tokens, ``R`` rows,
one compiled program per trace): prefill chunks of random lengths (1, fewer than ``W - 1``,
longer than a block), decode steps that carry a random tree of drafts (EAGLE; a chain and
zero drafts among them) of which a random path is accepted, pad rows, NaN everywhere no
request may read (rejected drafts, padding tokens, pad rows' tokens, freed slots before
their reuse, unused pool slots), slots reused after their request ends, and, with prefix
caching, new requests that start from a finished or running request's block state.

Checks: every accepted output within the dtype's rounding of the full pass (two programs),
every slot a request owns and every cached block state bit for bit (copies of inputs).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.numerics import assert_close
from support.short_conv import implementation_params
from support.tiers import tiered

from maskconv_kernels.ops.causal_conv1d import PAD_SLOT_ID, causal_conv1d, causal_conv1d_step

F32, BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
D = 8


@dataclasses.dataclass(eq=False)  # compared by identity
class Request:
    seq: np.ndarray        # every token it will accept, the cached prefix included
    prompt: int            # its prefill length
    slot: int
    start: int = 0         # tokens before its first step (a prefix-cache hit's prefix)
    done: int = 0          # tokens accepted so far, ``start`` included
    read: int | None = None  # the slot its first step reads (a cached block's), else its own
    table: np.ndarray | None = None  # (M,) block slots, prefix caching
    path: np.ndarray | None = None   # its accepted_path row for the next step
    outs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Trace:
    width: int
    dilation: int = 1
    drafts: int = 0        # k: the most drafts a decode row carries (tree mode)
    block: int | None = None  # K: prefix caching (chains only)
    x_dtype: np.dtype = F32
    pool_dtype: np.dtype = F32
    tokens: int = 24
    rows: int = 4
    slots: int = 48
    blocks: int = 8        # M
    longest: int = 40      # a request's most tokens of its own

    @property
    def window(self) -> int:
        return (self.width - 1) * self.dilation

    @property
    def state_len(self) -> int:
        return self.window + self.drafts


class Server:
    """The simulated scheduler: ``step()`` builds and runs one step; requests come and go."""

    def __init__(self, trace: Trace, seed: int, implementation=None, interpret=False, gated=False):
        self.t, self.rng = trace, np.random.default_rng(seed)
        self.w = jnp.asarray((0.5 * self.rng.standard_normal((trace.width, D))).astype(np.float32))
        self.b = jnp.asarray((0.5 * self.rng.standard_normal((D,))).astype(np.float32))
        # gated: a Qwen3-Next-style layer around the convolution, each token's projections
        # (mixed qkv, gate) in float32, the convolution's output gated and projected back.
        project = lambda: jnp.asarray((self.rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32))
        self.layer = (project(), project(), project()) if gated else None
        self.pool = jnp.full((trace.slots, trace.state_len, D), jnp.nan, trace.pool_dtype)
        self.free = list(range(trace.slots))
        self.rng.shuffle(self.free)
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.cached: list[tuple[Request, int, int]] = []  # (request, block m, slot): state after (m + 1) * K
        tree = trace.block is None
        plain = tree and trace.drafts == 0  # no drafts, no prefix caching: each request writes the slot it reads
        kw = dict(activation="silu", dilation=trace.dilation, implementation=implementation, interpret=interpret)

        def run(x, pool, qsl, read, write, fresh, extra):
            conv = lambda u: causal_conv1d_step(u, pool, self.w, self.b, query_start_loc=qsl, state_indices=read,
                                                write_indices=None if plain else write, has_initial_state=fresh,
                                                block_size=None if tree else trace.block, **extra, **kw)
            return self.around(conv, x)

        self.run = jax.jit(run, donate_argnums=1)

    def around(self, conv, x):
        """``conv(x)`` (its outputs and what it returns beside them), inside the gated layer if any."""
        if self.layer is None:
            return conv(x)
        w_in, w_gate, w_out = self.layer
        mixed = (x.astype(jnp.float32) @ w_in).astype(x.dtype)
        y, *rest = conv(mixed)
        gate = jax.nn.silu(x.astype(jnp.float32) @ w_gate)
        return ((y.astype(jnp.float32) * gate) @ w_out).astype(x.dtype), *rest

    # ------------------------------------------------------------------ requests
    def admit(self):
        t = self.t
        length = int(self.rng.integers(2, t.longest))
        seq = self.rng.standard_normal((length, D)).astype(t.x_dtype)
        start, read = 0, None
        if t.block is not None and self.cached and self.rng.random() < 0.5:  # a prefix-cache hit
            source, m, slot = self.cached[int(self.rng.integers(len(self.cached)))]
            start, read = (m + 1) * t.block, slot
            seq = np.concatenate([source.seq[:start], seq])
        slot = self.free.pop()
        table = None
        if t.block is not None:
            table = np.full((t.blocks,), PAD_SLOT_ID, np.int32)
            for m in range(start // t.block, min(t.blocks, (len(seq) - 1) // t.block + 1)):
                if self.free and len(self.free) > 4:
                    table[m] = self.free.pop()
        prompt = start + int(self.rng.integers(1, len(seq) - start + 1))
        self.running.append(Request(seq, prompt, slot, start, start, read, table))

    def retire(self, r: Request):
        self.running.remove(r)
        self.finished.append(r)
        self.check_slot(r)
        self.pool = self.pool.at[r.slot].set(jnp.nan)  # its slot's old content, for the next owner: never read
        self.free.insert(0, r.slot)

    # ------------------------------------------------------------------ a step
    def step(self):
        t = self.t
        while len(self.running) < t.rows - 1 and len(self.free) > 12:
            self.admit()
        chosen = [r for r in self.running if self.rng.random() < 0.8][:t.rows]
        x = np.full((t.tokens, D), np.nan, t.x_dtype)  # padding tokens: NaN, read by nobody
        qsl, read, write, fresh, parents, paths, table, computed, plans = [0], [], [], [], [], [], [], [], []
        budget = t.tokens - (t.rows - len(chosen))  # leave each pad row a token
        for r in chosen:
            tokens, par, accepted = self.plan(r, budget - qsl[-1])
            if tokens is None:
                continue
            x[qsl[-1]:qsl[-1] + len(tokens)] = tokens
            qsl.append(qsl[-1] + len(tokens))
            read.append(r.slot if r.done > r.start or r.read is None else r.read)
            write.append(r.slot)
            fresh.append(r.done > 0)
            parents += list(par)
            paths.append(r.path if r.path is not None else np.arange(t.drafts + 1))
            table.append(r.table)
            computed.append(r.done)
            plans.append((r, len(tokens), accepted, par))
        while len(read) < t.rows:  # pad rows, each with a NaN token where room is left
            n = 1 if qsl[-1] < t.tokens else 0
            qsl.append(qsl[-1] + n)
            read.append(PAD_SLOT_ID)
            write.append(PAD_SLOT_ID)
            fresh.append(True)
            parents += [-1] * n
            paths.append(np.arange(t.drafts + 1))
            table.append(np.full((t.blocks,), PAD_SLOT_ID, np.int32))
            computed.append(0)
        parents += [-1] * (t.tokens - len(parents))
        extra = {}
        if t.block is None and t.drafts:
            extra = dict(parents=jnp.asarray(parents, jnp.int32), accepted_path=jnp.asarray(np.stack(paths), jnp.int32))
        elif t.block is not None:
            extra = dict(block_indices=jnp.asarray(np.stack(table)), num_computed_tokens=jnp.asarray(computed))
        y, self.pool = self.run(jnp.asarray(x), self.pool, jnp.asarray(qsl, jnp.int32), jnp.asarray(read, jnp.int32),
                                jnp.asarray(write, jnp.int32), jnp.asarray(fresh), extra)
        y = np.asarray(y)
        if self.layer is None:  # (the gate of a NaN padding token is NaN: the layer's padding is not zeros)
            assert (y[qsl[len(plans)]:] == 0).all(), "padding and pad rows give zeros"
        for i, (r, n, accepted, par) in enumerate(plans):
            r.outs.append(y[qsl[i]:qsl[i + 1]][accepted])
            self.accept(r, n, accepted)
            if r.done == len(r.seq):
                self.retire(r)

    def plan(self, r: Request, room: int):
        """The row's tokens, their parents and the indices of the accepted ones (or ``None``
        when there is no room)."""
        t = self.t
        if room < 1:
            return None, None, None
        if r.done < r.prompt or t.drafts == 0:  # a prefill chunk (or a plain decode token)
            left = (r.prompt if r.done < r.prompt else len(r.seq)) - r.done
            n = min(left, room, int(self.rng.choice([1, max(t.window - 1, 1), self.rng.integers(1, 3 * t.tokens)])))
            return r.seq[r.done:r.done + n], np.arange(n) - 1, np.arange(n)
        # A decode row: the root (the next token, accepted) and a random tree of drafts.
        n = min(int(self.rng.integers(0, t.drafts + 1)) + 1, room)
        par = np.array([-1] + [int(self.rng.integers(0, j)) for j in range(1, n)])
        leaf = int(self.rng.integers(n))
        path = [leaf]
        while par[path[-1]] >= 0:
            path.append(int(par[path[-1]]))
        path = path[::-1][:len(r.seq) - r.done]  # no more than the request has left
        tokens = np.full((n, D), np.nan, t.x_dtype)  # rejected drafts: NaN
        tokens[path] = r.seq[r.done:r.done + len(path)]
        return tokens, par, np.array(path)

    def accept(self, r: Request, n: int, accepted: np.ndarray):
        """The request's history grows by the accepted tokens; its next accepted_path names
        them among the slot's last ``k + 1`` inputs (the step's ``n`` tokens are the last)."""
        k = self.t.drafts
        r.done += len(accepted)
        r.path = np.full((k + 1,), -1)
        kept = np.concatenate([np.arange(k + 1 - n), k + 1 - n + accepted]) if n <= k + 1 else np.arange(k + 1)
        r.path[:len(kept)] = kept
        if self.t.block is not None:
            for m in range(min(self.t.blocks, r.done // self.t.block)):
                if r.table[m] != PAD_SLOT_ID and (r, m, int(r.table[m])) not in self.cached:
                    self.cached.append((r, m, int(r.table[m])))

    # ------------------------------------------------------------------ checks
    def history(self, r: Request, upto: int) -> np.ndarray:
        """The last ``state_len`` inputs of the request's first ``upto`` tokens, zeros before."""
        inputs = r.seq[:upto]
        if self.layer is not None:  # the convolution's inputs: the mixed projection
            inputs = np.asarray((jnp.asarray(inputs, jnp.float32) @ self.layer[0]).astype(inputs.dtype))
        padded = np.concatenate([np.zeros((self.t.state_len, D)), np.asarray(inputs, np.float64)])
        return padded[len(padded) - self.t.state_len:]

    def same(self, actual, expected):
        """Bit for bit (copies of inputs), or, inside the gated layer, within the rounding of
        its projection, which the step's program and this check compute apart."""
        if self.layer is None:
            np.testing.assert_array_equal(actual, expected)
        else:
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)

    def check_slot(self, r: Request):
        slot = np.asarray(np.asarray(self.pool[r.slot]), np.float64)
        if self.t.drafts == 0:
            self.same(slot, self.history(r, r.done))
        else:  # the valid history the next step would read ends the slot's kept inputs
            kept = np.concatenate([slot[:self.t.window - 1], slot[self.t.window - 1 + r.path[r.path >= 0]]])
            self.same(kept[-self.t.window:], self.history(r, r.done)[-self.t.window:])

    def check(self):
        t = self.t
        for r in self.finished + self.running:
            if r.done == r.start:
                continue
            full = np.asarray(self.around(lambda u: (causal_conv1d(u[None], self.w, self.b, activation="silu",
                                                                  dilation=t.dilation)[0],), jnp.asarray(r.seq[:r.done]))[0])
            scale = float(np.abs(r.seq.astype(np.float64)).max() * np.abs(np.asarray(self.w)).max() * t.width + 1)
            scale *= 1 if self.layer is None else D * D  # two projections of D terms around it
            assert_close(np.concatenate(r.outs), full[r.start:], t.x_dtype, t.width, scale)
        for r in self.running:
            if r.done > r.start:  # (a request admitted but not yet scheduled owns an untouched slot)
                self.check_slot(r)
        pool = np.asarray(np.asarray(self.pool), np.float64)
        for r, m, slot in self.cached:
            self.same(pool[slot], self.history(r, (m + 1) * t.block))
        owned = {r.slot for r in self.running} | {s for _, _, s in self.cached}
        assert np.isnan(pool[[s for s in range(t.slots) if s not in owned]]).all(), "slots nobody owns are NaN"


def replay(trace: Trace, steps: int, seed: int, **kw) -> Server:
    """``steps`` random steps, then every check."""
    server = Server(trace, seed, **kw)
    for _ in range(steps):
        server.step()
    server.check()
    assert server.finished, "the trace ends a request"
    return server


TREES = [Trace(4, drafts=3), Trace(2, drafts=2), Trace(8, drafts=4, tokens=32), Trace(3, 2, drafts=2),
         Trace(4, drafts=3, x_dtype=BF16)]
CACHES = [Trace(4, block=4), Trace(3, block=8), Trace(6, block=4, x_dtype=BF16), Trace(2, 3, block=16)]
# Plain steps (no drafts, no prefix caching): what the TPU's mixed step kernel takes.
PLAINS = [Trace(4), Trace(3, 2, x_dtype=BF16), Trace(2, tokens=40, longest=60), Trace(4, x_dtype=BF16, pool_dtype=BF16)]


@pytest.mark.parametrize("trace", tiered(TREES, lambda t: t.width == 4 and t.x_dtype == F32),
                         ids=lambda t: f"W{t.width}_d{t.dilation}_k{t.drafts}_{np.dtype(t.x_dtype).name}")
def test_speculative_trees_pad_rows_and_slot_reuse(trace):
    replay(trace, 40, seed=trace.width)


@pytest.mark.parametrize("trace", tiered(CACHES, lambda t: t.width == 4),
                         ids=lambda t: f"W{t.width}_d{t.dilation}_K{t.block}_{np.dtype(t.x_dtype).name}")
def test_prefix_cache_hits_chunks_and_slot_reuse(trace):
    server = replay(trace, 40, seed=10 + trace.width)
    assert server.cached


def test_a_qwen3_next_style_gated_layer_served_equals_its_full_pass():
    """In-projection, the short convolution over the mixed channels, SiLU gate, out-projection:
    served through trees of drafts and chunked prefills, each request's accepted outputs
    equal the layer's full pass on its sequence."""
    replay(Trace(4, drafts=3), 30, seed=5, gated=True)


@pytest.mark.parametrize("trace", tiered(PLAINS, lambda t: t.width == 4 and t.x_dtype == F32),
                         ids=lambda t: f"W{t.width}_d{t.dilation}_{np.dtype(t.x_dtype).name}_{np.dtype(t.pool_dtype).name}")
def test_plain_steps_on_the_tpu_mixed_kernel(trace):
    """Steps of prefill chunks and decode tokens (NaN padding tokens and pad rows, slots
    reused) through the mixed step's kernel, named (interpreted off a TPU): each request's
    outputs and states equal its full pass."""
    replay(trace, 12, seed=3, implementation="pallas_mosaic_tpu", interpret=jax.default_backend() != "tpu")


@pytest.mark.parametrize("trace", tiered(CACHES, lambda t: t.width == 4 and t.x_dtype == F32),
                         ids=lambda t: f"W{t.width}_d{t.dilation}_K{t.block}_{np.dtype(t.x_dtype).name}")
def test_prefix_cache_steps_on_the_tpu_mixed_kernel(trace):
    """Prefix caching through the mixed step's kernel, named (interpreted off a TPU): block
    states written mid-chunk and at chunks' ends, cache hits that read a block's slot and
    write their own (``write_indices``), pad rows, slots reused: each request's outputs and
    states equal its full pass, and the cached blocks serve later requests."""
    server = replay(trace, 12, seed=10 + trace.width, implementation="pallas_mosaic_tpu",
                    interpret=jax.default_backend() != "tpu")
    assert server.cached


@pytest.mark.slow
@pytest.mark.parametrize("trace", [TREES[0], TREES[2], CACHES[0], CACHES[3]], ids=["trees_W4", "trees_W8",
                                                                                 "cache_W4", "cache_W2_d3"])
def test_thousands_of_steps(trace):
    replay(trace, 1000, seed=99)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", implementation_params())
@pytest.mark.parametrize("trace", [Trace(4, drafts=2, tokens=16, rows=3, longest=8),
                                   Trace(4, block=4, tokens=16, rows=3, longest=12),
                                   Trace(3, drafts=1, tokens=16, rows=3, longest=8, x_dtype=BF16)],
                         ids=["trees", "cache", "trees_bf16_f32pool"])
def test_every_backend_interpreted(implementation, trace):
    replay(trace, 8, seed=7, implementation=implementation, interpret=implementation != "xla")
