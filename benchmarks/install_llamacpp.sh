#!/usr/bin/env bash
# Builds llama-cpp-python (the llama.cpp peer of the SmolLM2 benchmark) from
# source for the CPU this runs on, into the active Python environment.
#
#   bash benchmarks/install_llamacpp.sh            # the tested version
#   LLAMA_CPP_PYTHON=llama-cpp-python==X bash benchmarks/install_llamacpp.sh
#
# llama.cpp chooses its CPU kernels at build time: GGML_NATIVE compiles for
# this machine's instructions (-march=native: AVX2, AVX-512 F/BW/VL/DQ, VNNI,
# BF16 where present), so the build belongs to the machine it was made on;
# build again on another CPU (pip's wheel cache is bypassed so that a wheel
# built elsewhere is never reused). On CPUs with AMX the AMX kernels are left
# out (-mno-amx-*): they crash on some AMX machines (SIGSEGV in
# ggml_backend_amx_mul_mat, llama.cpp issue 20824), and without them the
# repacked AVX-512 kernels run. The multimodal library is not built.
# Build time: 17 CPU minutes on one Skylake-SP core (2.5 GHz)
# (CMAKE_BUILD_PARALLEL_LEVEL raises it; pin with taskset if the machine is shared).
set -euo pipefail
package=${LLAMA_CPP_PYTHON:-llama-cpp-python==0.3.36}
args="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  export CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx"
  echo "AMX CPU: building without the AMX kernels ($no_amx)"
fi
unset SOURCE_DATE_EPOCH  # it turns GGML_NATIVE's default off
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1}
echo "CMAKE_ARGS=$args"
CMAKE_ARGS="$args" pip install --no-cache-dir --no-binary llama-cpp-python \
  --force-reinstall --no-deps "$package"
# Its own requirements, without letting pip touch torch or numpy's versions.
pip install "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0"
python -c "import llama_cpp; print(llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
