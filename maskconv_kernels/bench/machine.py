"""What every benchmark row carries beside its figures: the machine, the versions, the commit, the time.

A figure without them cannot be compared with another: :func:`metadata` is merged into
each row a benchmark writes, and :func:`header` prints it above the tables.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import jax

__all__ = ["metadata", "header", "cpu_model", "device_name", "commit", "short_commit", "loadavg", "cache_bytes"]

# The source checkout of an editable install (maskconv_kernels/ lies in it); an installed
# copy has no .git there, and then no commit is claimed.
_SOURCE = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform`` where that is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def device_name(device=None) -> str:
    """A GPU's kind (``NVIDIA H200``), or the CPU's model and core count."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "cpu":
        return device.device_kind
    return f"{cpu_model()}, {os.cpu_count()} cores"


def commit() -> str | None:
    """The git commit of the source this package runs from (``-dirty`` when tracked files differ).

    ``MASKCONV_COMMIT`` in the environment overrides it (a copy of a checkout without
    ``.git``); ``None`` for an installed copy.
    """
    if os.environ.get("MASKCONV_COMMIT"):
        return os.environ["MASKCONV_COMMIT"]
    if not (_SOURCE / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_SOURCE, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_SOURCE,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def loadavg() -> float | None:
    """The 1-minute load average: other processes slow every figure measured beside them."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def metadata(preset: str, command: str) -> dict:
    """The fields merged into every row: device, CPU, load, versions, commit, UTC time, preset and command."""
    import jaxlib

    from .. import __version__

    device = jax.devices()[0]
    meta = {
        "device": device.device_kind if device.platform != "cpu" else f"CPU: {cpu_model()}",
        "platform": device.platform,
        "device_count": jax.device_count(),
        "gpu_driver": _nvidia_smi("driver_version") if device.platform == "gpu" else None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": loadavg(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "maskconv_kernels": __version__,
        "commit": commit(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "preset": preset,
        "command": command,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # not installed, or broken on this machine: it is only metadata
        meta["triton"] = None
    return meta


def short_commit(commit_: str | None) -> str:
    """The first 12 hex digits (and ``-dirty``), or ``unknown``."""
    if not commit_ or commit_ == "unknown":
        return "unknown"
    return commit_[:12] + ("-dirty" if commit_.endswith("-dirty") else "")


def header(rows: list[dict]) -> str:
    """The machine, versions, commit and command of a run (from its first row)."""
    meta = rows[0]
    version = f"maskconv-kernels {meta['maskconv_kernels']}, " if meta.get("maskconv_kernels") else ""
    cores = f", {meta['cpu_count']} CPU cores" if meta.get("cpu_count") else ""
    driver = f", driver {meta['gpu_driver']}" if meta.get("gpu_driver") else ""
    return "\n".join([
        f"Device: {meta['device']} ({meta.get('platform', 'cpu')}{cores}{driver}); "
        f"jax {meta['jax']}, jaxlib {meta['jaxlib']}, Python {meta['python']}; "
        f"{version}commit {short_commit(meta.get('commit'))}; {meta['time_utc']}; "
        f"load average at start {meta.get('loadavg_at_start')}.",
        "",
        f"Command: `{meta['command']}`",
    ])


def cache_bytes(platform_name: str) -> int:
    """The last-level cache: an H100/H200's L2 on GPUs, the CPU's L3 from sysfs (32 MiB if unreadable)."""
    if platform_name == "gpu":
        return 60 << 20
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) << 10 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return 32 << 20
