"""``causal_conv1d``: the short causal convolutions of sequence models, exact across packed documents.

* :mod:`.api`: :func:`causal_conv1d`;
* :mod:`.update`: :func:`causal_conv1d_update`, serving from a pool of states;
* :mod:`.step`: :func:`causal_conv1d_step`, a continuous-batching scheduler's step in one call;
* :mod:`.checks`: the arguments, checked into a :class:`~.checks.Problem`;
* :mod:`.state`: the final state;
* :mod:`.reference`: the float64 NumPy oracles;
* :mod:`.backends`: the implementations table; :mod:`.xla` and :mod:`.pallas_triton`.
"""
from .api import IMPLEMENTATIONS, PREFERENCE, causal_conv1d
from .checks import ACTIVATIONS
from .reference import causal_conv1d_reference, causal_conv1d_update_reference
from .step import causal_conv1d_step
from .update import PAD_SLOT_ID, causal_conv1d_update

__all__ = [
    "causal_conv1d", "causal_conv1d_update", "causal_conv1d_step", "causal_conv1d_reference",
    "causal_conv1d_update_reference",
    "ACTIVATIONS", "PAD_SLOT_ID", "IMPLEMENTATIONS", "PREFERENCE",
]
