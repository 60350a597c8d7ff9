"""The optional dependencies: the modules that need one say which extra installs it."""
from __future__ import annotations

import importlib

__all__ = ["require"]


def require(package: str, extra: str, needed_by: str):
    """Imports ``package``, or raises an ImportError naming the extra that installs it.

    Only a missing ``package`` itself is turned into that message; a failure inside an
    installed one (a dependency of its own, a version clash) propagates as it is.
    """
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as e:
        if e.name != package:
            raise
        raise ImportError(
            f"{needed_by} needs {package}, which is not installed: pip install 'maskconv-kernels[{extra}]' "
            f"(or pip install {package})"
        ) from e
