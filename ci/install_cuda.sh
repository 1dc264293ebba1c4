#!/usr/bin/env bash
# Inside the manylinux_2_28 (AlmaLinux 8) build image: the CUDA 13.0 compiler and
# runtime headers from NVIDIA's RHEL 8 repository, at /usr/local/cuda.
set -euo pipefail
dnf install -y dnf-plugins-core
dnf config-manager --add-repo https://developer.download.nvidia.com/compute/cuda/repos/rhel8/x86_64/cuda-rhel8.repo
dnf install -y cuda-nvcc-13-0 cuda-cudart-devel-13-0 cuda-cuobjdump-13-0
ln -sfn /usr/local/cuda-13.0 /usr/local/cuda
/usr/local/cuda/bin/nvcc --version
