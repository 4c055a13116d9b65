#!/usr/bin/env bash
# Makes a virtual environment with llm-compressor (the GPTQ / AWQ peer of
# `python -m benchmarks.calibration`) and prints its Python, for
# `--peer-python`. It gets its own environment because llm-compressor pins
# transformers (0.14: transformers<=5.17) below the benchmark environment's.
#
#   bash benchmarks/install_llmcompressor.sh [DIR]     # default .venv-llmcompressor
#
# torch is the version this repository is tested with; on a machine whose
# PyPI torch is a CUDA build, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# for the CPU wheel.
set -euo pipefail
directory=${1:-.venv-llmcompressor}
python -m venv "$directory"
"$directory/bin/pip" install --quiet "torch==${TORCH_VERSION:-2.13.0}" "${LLMCOMPRESSOR:-llmcompressor==0.14.0.1}"
"$directory/bin/python" -c "import llmcompressor, torch, transformers; print('llm-compressor', llmcompressor.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" >&2
echo "$directory/bin/python"
