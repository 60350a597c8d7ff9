"""The causality audit: does any output of a model depend on an input it must not see?

An autoregressive model ``f: x -> y`` is causal when the output at position ``p`` does
not depend on any input that ``p`` must not see (the future, in raster order for
images). "Does not depend" has an exact meaning, which the audit checks at every output
position (or a stated sample of them):

* **gradient**: ``|dy_p / dx_q|`` is exactly ``0.0`` for every forbidden input ``q``.
  One backward pass per output position (reverse mode, batched with ``vmap`` over the
  positions, in chunks), or one forward-mode pass per input position where that is
  cheaper. Gradients are measured in float32 whatever the model's dtype: the audit
  differentiates with respect to a float32 copy of ``x`` that is cast to ``x.dtype``
  on the way in, and casts ``y`` to float32 on the way out.
* **NaN isolation**: with every input forbidden to ``p`` replaced by NaN, the outputs at
  ``p`` are bit-identical to the clean ones. This is what ``lax.conv(kernel * mask)``
  fails on every platform (``0 * NaN = NaN``) although its gradient leak is 0 on CPU.
* **perturbation** (black-box mode, for models that are not differentiable in their
  input: integer tokens, sampling inside): every forbidden input is changed to another
  value (another token, another float) and the outputs at ``p`` must stay
  bit-identical; batched over ``p``.

The report names the first offending ``(p, q)`` pair (the earliest output that leaks,
and the earliest input it must not see but does) and the worst ones, with values; it
prints as a table and converts to JSON.

Layout: ``x`` is ``(N, *positions, C)`` (three or more dims), ``(N, L)`` (tokens) or
``(L,)``; ``y`` has the same sizes on the position axes (``position_axes`` overrides the
guess). Every other axis (the batch, channels, logits) belongs to the position: the
output "at p" is every element of ``y`` at ``p``, in every example of the batch, and an
input forbidden to ``p`` is forbidden in every example (so normalising over the batch
or the sequence is caught too). ``sub_pixels=3`` splits the last axis of ``x`` and of
``y`` into R, G, B groups ordered after the pixel (the original PixelCNN's order).

The package, by check kind: :mod:`.api` (the entry points), :mod:`.order` (the causal
order: ranks, forbidden pairs, the sample), :mod:`.units` (``x`` and ``y`` as units),
:mod:`.gradient` and :mod:`.blackbox` (the checks), :mod:`.report` (what they found).
The leak figures come from :mod:`maskconv_kernels.leaks`, shared with the leak report
and the benchmarks.
"""
from .api import as_function, assert_causal, audit_causal
from .report import CausalityError, CausalityReport, CheckResult, Offence

__all__ = ["audit_causal", "assert_causal", "as_function", "CausalityReport", "CausalityError", "CheckResult",
           "Offence"]
