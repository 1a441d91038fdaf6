"""Adapter tests: vLLM glue. Engines, where any, run in-process (tests/conftest.py
sets VLLM_ENABLE_V1_MULTIPROCESSING=0 and a 1 GiB CPU KV cache).

The model pair: the bundled one (assets/) when it is complete, else the smoke
pair a rebuild leaves in /tmp/pair_smoke (same formats).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from vllm_eagle_tree import assets

torch.set_num_threads(1)


def _complete(target: Path, e1: Path, e3: Path) -> bool:
    return (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file() \
        and (e1 / "config.json").is_file() and (e3 / "config.json").is_file()


def find_pair() -> tuple[Path, Path, Path] | None:
    candidates = [(assets.TARGET, assets.EAGLE1_HEAD, assets.EAGLE3_HEAD)]
    smoke = Path(os.environ.get("VLLM_EAGLE_TREE_PAIR", "/tmp/pair_smoke"))
    candidates.append((smoke / "target", smoke / "eagle1-head", smoke / "eagle3-head"))
    for c in candidates:
        if _complete(*c):
            return c
    return None


@pytest.fixture(scope="session")
def pair() -> tuple[str, str, str]:
    """(target, eagle1-head, eagle3-head) folder paths."""
    found = find_pair()
    if found is None:
        pytest.skip("no complete model pair (assets/ or /tmp/pair_smoke)")
    return tuple(str(p) for p in found)
