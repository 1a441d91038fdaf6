"""Small helpers shared by the kernel modules (no vLLM imports)."""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["interpret_mode", "triton_gpu_backend", "next_pow2", "cdiv", "num_sms"]


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Triton reads the variable when a kernel is decorated, so it must be set
    before the kernel modules are imported (tests/kernels/conftest.py does).
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def triton_gpu_backend() -> str | None:
    """'cuda' or 'hip' when Triton has a GPU backend with a device, else None.

    The CPU build of vLLM ships Triton without a CPU backend (DESIGN.md
    section 1); there this returns None and everything runs the references.
    """
    try:
        import triton
        target = triton.runtime.driver.active.get_current_target()
        backend = getattr(target, "backend", None)
        return backend if backend in ("cuda", "hip") else None
    except Exception:  # no driver, no device, or a Triton without GPU support
        return None


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
