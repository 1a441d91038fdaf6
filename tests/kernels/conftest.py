"""Kernel tests: Triton kernels vs their PyTorch references.

Without a GPU the kernels run in Triton's CPU interpreter. Triton decides
interpretation when a function is decorated with ``@triton.jit`` (including
its own ``tl.philox`` & co. at ``import triton``), so TRITON_INTERPRET must be
in the environment before anything in the process imports triton. We set it
here, at conftest import (before the test modules import the kernels); it is
process-wide and stays set for the rest of the session (vLLM's CPU build
disables Triton anyway, so other test folders are unaffected). If something
imported triton earlier without it (e.g. a test folder collected before this
one imported vLLM), the kernel tests are skipped with a hint instead of
failing obscurely: run ``TRITON_INTERPRET=1 pytest ...`` or run tests/kernels
on its own.

On a CUDA machine, ``TRITON_INTERPRET=0 pytest tests/kernels`` runs the same
tests natively on the GPU (scripts/gpu_kernels_bench.py does).
"""
import os
import sys

_TRITON_TOO_EARLY = "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # for _kernel_test_utils


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: larger kernel cases (deselect with -m 'not slow')")


def pytest_collection_modifyitems(config, items):
    if not _TRITON_TOO_EARLY:
        return
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="triton was imported before tests/kernels/conftest.py could set "
                                   "TRITON_INTERPRET=1; run with TRITON_INTERPRET=1 in the "
                                   "environment or run tests/kernels separately")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    from vllm_eagle_tree.triton_kernels._common import interpret_mode
    if interpret_mode():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device")


@pytest.fixture(scope="session")
def interpret():
    from vllm_eagle_tree.triton_kernels._common import interpret_mode
    return interpret_mode()
