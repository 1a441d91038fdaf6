#!/usr/bin/env python
"""Write assets/prompts.json: 256 prompts cut from the held-out split of the
corpus (stdlib files whose name hash puts them outside training; see
scripts/build_pair.py). Each prompt is 3-8 whole lines of Python source.

    .venv/bin/python scripts/make_prompts.py
"""
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from build_pair import corpus_files  # noqa: E402


def main(n=256):
    _, held = corpus_files()
    rng = random.Random(0)
    prompts = set()
    while len(prompts) < n:
        lines = rng.choice(held).splitlines(keepends=True)
        if len(lines) < 10:
            continue
        start = rng.randrange(0, len(lines) - 8)
        text = "".join(lines[start:start + rng.randint(3, 8)])
        if 40 <= len(text) <= 400 and text.strip():
            prompts.add(text)
    out = sorted(prompts)
    rng.shuffle(out)
    (ROOT / "assets" / "prompts.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(out)} prompts")


if __name__ == "__main__":
    main()
