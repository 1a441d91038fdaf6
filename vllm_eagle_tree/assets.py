"""Paths of the bundled model pair (``assets/``) and the held-out prompts."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "assets"
TARGET = ASSETS / "target"
EAGLE1_HEAD = ASSETS / "eagle1-head"
EAGLE3_HEAD = ASSETS / "eagle3-head"
PROMPTS = ASSETS / "prompts.json"
# The cost-realistic target is built on demand (scripts/make_deep_target.py):
# the bundled target plus zero-residual identity layers.
DEEP_TARGET = ROOT / "build" / "deep-target"

HEADS = {"eagle": EAGLE1_HEAD, "eagle3": EAGLE3_HEAD}


def heldout_prompts(n: int | None = None) -> list[str]:
    """Held-out prompts (files the target and heads never trained on)."""
    prompts = json.loads(PROMPTS.read_text())
    return prompts if n is None else prompts[:n]
