#!/usr/bin/env bash
# Build Horovod 0.28.1 (its last release) for the installed torch, CPU only: PyTorch + Gloo, no
# MPI, no CUDA. Usage: tools/build_horovod.sh   (then: horovodrun --check-build)
#
# Why a script and not `pip install horovod`: 0.28.1 compiles its PyTorch extension with
# -std=c++14 and torch >= 2.1's headers need C++17. Upstream fixed that after the release (horovod
# PR 3998, "Compile using C++17 when using PyTorch 2.1"); no release carries it, so this takes the
# release's sdist from PyPI, applies the C++17 change (below) and compiles it against the torch
# installed here (--no-build-isolation: pip's isolated build would fetch another torch).
# PYTHON=... picks the interpreter (default python3); MAKEFLAGS=-jN the compile jobs.
# Needs CMake 3.13 or newer (Horovod's own minimum; its setup.py fetches 3.13 with pip when the
# cmake on PATH is older, HOROVOD_CMAKE=/path/to/cmake picks another), CMake 4 included: the gloo
# Horovod bundles declares cmake_minimum_required(VERSION 2.8.12), which CMake 4 refuses
# ("Compatibility with CMake < 3.5 has been removed"); CMAKE_POLICY_VERSION_MINIMUM=3.5 (below)
# lets CMake 4 configure it, and CMake 3, which still accepts gloo's line, ignores the variable.
set -euo pipefail
PYTHON=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")   # never inside the checkout
trap 'rm -rf "$work"' EXIT
cd "$work"
"$PYTHON" -m pip download -q --no-deps --no-binary horovod horovod==0.28.1 -d .
tar xzf horovod-0.28.1.tar.gz
cd horovod-0.28.1
# The C++17 change, two lines of CMake: horovod/torch/CMakeLists.txt compiles the PyTorch
# extension as C++17 for torch >= 2.1 (upstream's fix, PR 3998), and the top-level CMakeLists.txt
# the rest as C++17 too (horovod issue 3941's change): with the extension alone in C++17 the link
# fails, "multiple definition of gloo::rendezvous::Store::kDefaultTimeout" (a static constexpr
# member is an inline variable in C++17 and an out-of-line definition in gloo's C++14 objects).
patch -p1 <<'PATCH'
--- a/CMakeLists.txt
+++ b/CMakeLists.txt
@@ -16,7 +16,7 @@
 
 project(horovod CXX)
 
-set(CMAKE_CXX_STANDARD 14)
+set(CMAKE_CXX_STANDARD 17)
 set(CMAKE_CXX_STANDARD_REQUIRED ON)
 set(CMAKE_CXX_EXTENSIONS OFF)
 
--- a/horovod/torch/CMakeLists.txt
+++ b/horovod/torch/CMakeLists.txt
@@ -63,7 +63,9 @@
 parse_version(${Pytorch_VERSION} VERSION_DEC)
 add_definitions(-DPYTORCH_VERSION=${VERSION_DEC} -DTORCH_API_INCLUDE_EXTENSION_H=1)
 set(Pytorch_CXX11 ${Pytorch_CXX11} PARENT_SCOPE)
-if(NOT Pytorch_VERSION VERSION_LESS "1.5.0")
+if(NOT Pytorch_VERSION VERSION_LESS "2.1.0")
+    set(CMAKE_CXX_STANDARD 17)
+elseif(NOT Pytorch_VERSION VERSION_LESS "1.5.0")
     set(CMAKE_CXX_STANDARD 14)
 endif()
 
PATCH
# PyTorch + Gloo, nothing else: no MPI, no CUDA kernels (a GPU setting in the environment would
# make this a GPU build), no TensorFlow or MXNet.
unset HOROVOD_GPU HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo
export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}   # setup.py's default is -j8, whatever the machine
export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}   # CMake 4: gloo (above)
log="${TMPDIR:-/tmp}/horovod-build.log"
start=$SECONDS
torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)')
echo "building Horovod 0.28.1 against torch $torch_version (several minutes; log: $log)"
if ! "$PYTHON" -m pip install --no-build-isolation --no-cache-dir -v . >"$log" 2>&1; then
    grep -m 20 -E "error:|undefined reference|Error [0-9]" "$log" >&2 || tail -20 "$log" >&2
    echo "error: the Horovod build failed: the first errors above, the whole log in $log" >&2
    exit 1
fi
echo "Horovod 0.28.1 built and installed in $((SECONDS - start)) s"
cd /   # the checks import the installed package, not the source tree
"$PYTHON" -c "import horovod, horovod.torch; print('horovod', horovod.__version__, 'with torch')"
"$PYTHON" -m horovod.runner.launch --check-build   # = horovodrun --check-build
