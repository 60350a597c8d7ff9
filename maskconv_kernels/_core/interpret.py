"""``interpret=True`` where there is nothing to interpret: said with a ``UserWarning``, not ignored.

``interpret=True`` runs a kernel implementation's kernels in their interpreter, on any
platform. The ``xla`` implementation is made of XLA operations, which run on every
platform as they are: it has no kernel to interpret, and a call asking for one runs as
``interpret=False`` would, to the bit. Saying nothing would hide a slip: a test written
to exercise a kernel on CPU (with ``implementation="xla"``) would exercise none and
pass. So every op that takes ``interpret`` warns when every implementation its call can
run is ``xla``, and then runs it with ``interpret=False``. ``implementation=None`` is
not warned about where a platform's preference holds kernel implementations (every op's
today: ``causal_conv1d``'s TPU kernels lead the TPU's), which ``interpret=True`` runs in
their interpreter where the function is lowered for that platform.
Called by :meth:`~maskconv_kernels._core.registry.Registry.resolve`.
"""
from __future__ import annotations

import os
import sys
import warnings

__all__ = ["nothing_to_interpret"]

XLA = "xla"


def nothing_to_interpret(op: str, registry, implementation: str | None, interpret: bool) -> bool:
    """Whether ``interpret=True`` is void for this call (it can run ``xla`` only); warns once per call site if so.

    Args:
      op: the public function called, named in the warning.
      registry: the op's :class:`~maskconv_kernels._core.registry.Registry` (its
        implementations and the order ``implementation=None`` tries them in).
      implementation: the name given (already checked), or ``None``.
      interpret: the flag given.
    """
    if not interpret:
        return False
    runs = registry.candidates(None if implementation is None else registry.get(implementation))
    if any(record.name != XLA for record in runs):
        return False
    kernels = ", ".join(f'"{name}"' for name in registry.names if name != XLA)
    given = 'implementation="xla"' if implementation is not None else f'implementation=None, which runs "xla" for {op}'
    warnings.warn(
        f"{op}: interpret=True has no effect with {given}: XLA operations run on every platform, so there is no "
        f"kernel to interpret. Drop interpret=True, or name a kernel implementation ({kernels}) to run its kernels "
        "in their interpreter.",
        UserWarning,
        stacklevel=_user_stacklevel(),
    )
    return True


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_stacklevel() -> int:
    """The ``stacklevel`` (for the caller's ``warnings.warn``) of the first frame outside this package.

    That frame made the call: the user's line, or under ``jit`` the user's traced
    function; however many of the package's functions (a stream, a Flax module, an op
    calling another) lie between.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
