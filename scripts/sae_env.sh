#!/usr/bin/env bash
# Builds a separate venv holding sae-lens, used by the tests only as an oracle (scripts/sae_oracle.py,
# I/O through safetensors): sae-lens 6.54 needs transformer-lens<4, the project's main env has 4.x.
#
# Usage: bash scripts/sae_env.sh [DIR]     (default: ${TMPDIR:-/tmp}/tl-vllm-hooks-sae-lens)
# The venv uses --system-site-packages so the system torch is reused (pinned by a constraints file so
# pip never pulls another torch); transformer-lens 3.x and sae-lens are installed into the venv and
# shadow the system's transformer-lens there only. The system environment is not modified.
# Idempotent: an existing venv that already imports the right versions is reused (a flock guards
# concurrent callers). Progress goes to stderr; the last (only) stdout line is the venv's python.
# Env: PYTHON (base interpreter, default python3), SAE_LENS_VERSION (default 6.54.0).
set -euo pipefail

SAE_LENS_VERSION="${SAE_LENS_VERSION:-6.54.0}"
BASE_PY="${PYTHON:-python3}"
DIR="${1:-${TMPDIR:-/tmp}/tl-vllm-hooks-sae-lens}"
DIR="$(mkdir -p "$(dirname "$DIR")" && cd "$(dirname "$DIR")" && pwd)/$(basename "$DIR")"
VPY="$DIR/bin/python"
MARK="$DIR/.tl_vllm_hooks_sae_env_ok"

log() { echo "sae_env: $*" >&2; }

# Fast check (no ~10 s sae_lens import): metadata versions, and that the venv's transformer_lens
# is the one found first.
env_ok() {
  [ -x "$VPY" ] && [ -f "$MARK" ] && "$VPY" - "$SAE_LENS_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, importlib.util, sys
assert md.version("sae-lens") == sys.argv[1]
assert md.version("transformer-lens").split(".")[0] == "3"
spec = importlib.util.find_spec("transformer_lens")
assert spec.origin.startswith(sys.prefix), spec.origin
assert importlib.util.find_spec("torch") is not None
EOF
}

if env_ok; then
  echo "$VPY"
  exit 0
fi

mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock"
flock 9
if env_ok; then  # built by a concurrent caller while we waited
  echo "$VPY"
  exit 0
fi

t0=$(date +%s)
TORCH_VER="$("$BASE_PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [ -z "$TORCH_VER" ]; then
  log "WARNING: no torch in $BASE_PY; pip will download one (large)"
fi

if [ -e "$DIR" ]; then
  log "removing broken/incomplete venv $DIR"
  rm -rf "$DIR"
fi
log "creating venv $DIR (--system-site-packages, base $("$BASE_PY" -c 'import sys; print(sys.executable)'))"
"$BASE_PY" -m venv --system-site-packages "$DIR"
# Where BASE_PY is itself a venv's (the README's command 1 makes one), --system-site-packages reaches the base
# interpreter's packages, not that venv's: a .pth file adds the venv's, after this one's own.
"$BASE_PY" -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
  >"$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tl_vllm_hooks_base_env.pth"

CONSTRAINTS="$DIR/constraints.txt"
: >"$CONSTRAINTS"
[ -n "$TORCH_VER" ] && echo "torch==$TORCH_VER" >>"$CONSTRAINTS"

LOG="$DIR/pip-install.log"
log "pip install sae-lens==$SAE_LENS_VERSION 'transformer-lens<4' (torch pinned: ${TORCH_VER:-none}); log: $LOG"
# PIP_USER=0: never a --user install; the venv's own pip writes into the venv only.
if ! PIP_USER=0 PIP_NO_INPUT=1 "$VPY" -m pip install --disable-pip-version-check \
    -c "$CONSTRAINTS" "sae-lens==$SAE_LENS_VERSION" "transformer-lens<4" >"$LOG" 2>&1; then
  grep -v "is ignored: it is neither a file nor a directory" "$LOG" | tail -n 40 >&2
  log "pip install failed"
  exit 1
fi

# Full check: real imports, versions, torch untouched.
if ! "$VPY" - "$SAE_LENS_VERSION" "$TORCH_VER" >&2 <<'EOF'
import importlib.metadata as md, sys
import torch, transformer_lens, sae_lens  # noqa: F401
assert md.version("sae-lens") == sys.argv[1], md.version("sae-lens")
tl = md.version("transformer-lens")
assert tl.split(".")[0] == "3", tl
assert transformer_lens.__file__.startswith(sys.prefix), transformer_lens.__file__
if sys.argv[2]:
    assert torch.__version__ == sys.argv[2], (torch.__version__, sys.argv[2])
    assert not torch.__file__.startswith(sys.prefix), "torch was installed into the venv"
print(f"sae_env: ok: sae-lens {md.version('sae-lens')}, transformer-lens {tl}, torch {torch.__version__}")
EOF
then
  log "venv check failed"
  exit 1
fi
touch "$MARK"
log "built in $(($(date +%s) - t0)) s"
echo "$VPY"
