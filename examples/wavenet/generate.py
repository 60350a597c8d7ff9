"""WaveNet-style generation with decode caches: a dilated causal stack, one sample per step.

    python examples/wavenet/generate.py            # --length 1024 --batch 4

A WaveNet (van den Oord et al., 2016: gated dilated causal convolutions, dilations
1, 2, ..., 512, residual and skip connections, a softmax over 256 mu-law levels) built
from :class:`maskconv_kernels.flax.MaskedConv` with ``padding="CAUSAL"``. The
parameters are random (generation speed does not depend on training). It generates
``--batch`` sequences of ``--length`` samples from the same key twice:

* naively: one full forward pass over the whole sequence per sample (``length``
  passes), what generation costs without caches;
* with decode caches (``MaskedConv(decode=True)``): each layer keeps a ring buffer of
  its last ``dilation + 1`` inputs and computes one output per step (Paine et al.
  2016, "Fast WaveNet Generation Algorithm"; Ramachandran et al. 2017),

checks that the samples are identical, and prints both times.
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import maskconv_kernels as mk
from maskconv_kernels.flax import MaskedConv

DILATIONS = tuple(2**i for i in range(10))


def gate(a: jax.Array) -> jax.Array:
    value, gate_ = jnp.split(a, 2, axis=-1)
    return jnp.tanh(value) * nn.sigmoid(gate_)


class WaveNet(nn.Module):
    """``(N, L, 1)`` inputs in ``[-1, 1]`` -> ``(N, L, levels)`` logits of each next sample.

    The logits at ``t`` depend on inputs strictly before ``t``: the input layer's mask
    keeps only the tap at ``t - 1``. With ``decode=True``, each call takes the sample at
    ``t - 1`` as ``(N, 1, 1)`` and returns the logits at ``t``, ``(N, 1, levels)``.
    """

    levels: int = 256
    channels: int = 32
    dilations: tuple[int, ...] = DILATIONS
    decode: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.channels
        # Kernel 2, causal: tap 0 reads t - 1, tap 1 reads t (masked: the sample being predicted).
        h = MaskedConv(c, 2, padding="CAUSAL", mask=np.array([True, False]), decode=self.decode,
                       decode_shift=1, name="input")(x)
        skip = 0.0
        for i, d in enumerate(self.dilations):
            z = gate(MaskedConv(2 * c, 2, padding="CAUSAL", kernel_dilation=d, decode=self.decode, name=f"dilated{i}")(h))
            h = h + nn.Dense(c, name=f"residual{i}")(z)
            skip = skip + nn.Dense(c, name=f"skip{i}")(z)
        return nn.Dense(self.levels, name="out")(nn.relu(nn.Dense(c, name="head")(nn.relu(skip))))


def to_input(levels: jax.Array, n_levels: int) -> jax.Array:
    """Integer levels ``(N, L)`` -> ``(N, L, 1)`` in ``[-1, 1]``."""
    return (levels[..., None].astype(jnp.float32) / (n_levels - 1)) * 2.0 - 1.0


@functools.partial(jax.jit, static_argnames=("model", "n", "length", "steps"))
def generate_naive(model: WaveNet, variables, key, n: int, length: int, steps: int | None = None):
    """``(n, length)`` int32 levels; one full forward pass per sample (the first ``steps`` only, if given)."""

    def body(t, carry):
        key, seq = carry
        logits = model.apply(variables, to_input(seq, model.levels))
        key, sub = jax.random.split(key)
        return key, seq.at[:, t].set(jax.random.categorical(sub, logits[:, t]))

    return jax.lax.fori_loop(0, length if steps is None else steps, body, (key, jnp.zeros((n, length), jnp.int32)))[1]


@functools.partial(jax.jit, static_argnames=("model", "n", "length"))
def generate_cached(model: WaveNet, variables, key, n: int, length: int):
    """``(n, length)`` int32 levels; each layer computes one position per step from its cache."""
    dec = model.clone(decode=True)
    cache = dec.init(jax.random.key(0), jnp.zeros((n, length, 1)))["cache"]

    def step(carry, t):
        cache, key, previous = carry
        logits, mutated = dec.apply(
            {"params": variables["params"], "cache": cache}, to_input(previous, model.levels)[:, None], mutable=["cache"]
        )
        key, sub = jax.random.split(key)
        sample = jax.random.categorical(sub, logits[:, 0])
        return (mutated["cache"], key, sample), sample

    start = (cache, key, jnp.zeros((n,), jnp.int32))  # the sample "before" t = 0: never read
    return jnp.moveaxis(jax.lax.scan(step, start, jnp.arange(length))[1], 0, 1)


@functools.partial(jax.jit, static_argnames=("model",))
def regenerate_from_logits(model: WaveNet, variables, key, samples):
    """What :func:`generate_naive` draws from ``key``, from one full pass over its result ``samples``.

    The logits at ``t`` read samples before ``t`` only (exactly: masked taps are never
    read), so the later samples, zeros during naive generation, do not change them.
    """
    logits = model.apply(variables, to_input(samples, model.levels))

    def draw(key, t):
        key, sub = jax.random.split(key)
        return key, jax.random.categorical(sub, logits[:, t])

    return jnp.moveaxis(jax.lax.scan(draw, key, jnp.arange(samples.shape[1]))[1], 0, 1)


def seconds(fn, *args) -> tuple[np.ndarray, float]:
    """``(result, seconds of the second call)``: the first call compiles."""
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return np.asarray(out), time.perf_counter() - t


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = WaveNet(channels=args.channels)
    variables = model.init(jax.random.key(args.seed), jnp.zeros((1, args.length, 1)))
    key = jax.random.key(args.seed + 1)
    naive, t_naive = seconds(generate_naive, model, variables, key, args.batch, args.length)
    cached, t_cached = seconds(generate_cached, model, variables, key, args.batch, args.length)
    same = bool((naive == cached).all())
    print(f"WaveNet, dilations 1..512 (receptive field {sum(DILATIONS) + 1} samples), {args.channels} channels, "
          f"{args.batch} x {args.length} samples from the same key: identical: {same}")
    print(f"  naive (one full forward pass per sample): {t_naive:.2f} s")
    print(f"  cached (MaskedConv(decode=True)):          {t_cached:.3f} s  ({t_naive / t_cached:.0f}x faster)")
    print(f"  on {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__} "
          f"({jax.default_backend()}), flax {flax.__version__}, maskconv_kernels {mk.__version__}")
    if not same:
        sys.exit("cached and naive samples differ")


if __name__ == "__main__":
    main()
