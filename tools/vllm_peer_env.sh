#!/usr/bin/env bash
# A Python that can import vLLM's KV cache manager, for the peers benchmark's vLLM column.
#
#   bash tools/vllm_peer_env.sh [VENV_DIR] [VLLM_VERSION]
#
# Makes VENV_DIR (default /tmp/vllmenv) with --system-site-packages, so it sees
# the torch and blocktrie already installed here, installs vLLM VLLM_VERSION
# (default 0.33.0) without its dependencies (its pinned torch is a multi-GB CUDA
# build), then installs one by one the modules its import of
# `vllm.v1.core.kv_cache_manager` still asks for, until that import works.
# Prints the interpreter to pass as `python -m bench.run --sections peers
# --vllm-python PY` (or to export as BLOCKTRIE_VLLM_PYTHON). vLLM is never a
# dependency of blocktrie; nothing in CI needs this.
set -euo pipefail
venv=${1:-/tmp/vllmenv}
version=${2:-0.33.0}
probe="import vllm.v1.core.kv_cache_manager"
[ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv"
py="$venv/bin/python"
"$py" -c "import vllm" 2>/dev/null || "$py" -m pip install -q --no-deps "vllm==$version"
declare -A package=(
  [cv2]=opencv-python-headless [PIL]=pillow [yaml]=pyyaml [google]=protobuf
  [sklearn]=scikit-learn [zmq]=pyzmq
)
for _ in $(seq 1 40); do
  missing=$({ "$py" -c "$probe" 2>&1 || true; } | sed -n "s/.*No module named '\([^'.]*\).*/\1/p" | head -1)
  [ -z "$missing" ] && break
  echo "vllm_peer_env: installing ${package[$missing]:-$missing} (vLLM's import asks for $missing)" >&2
  "$py" -m pip install -q --no-warn-conflicts "${package[$missing]:-$missing}"
done
"$py" -c "$probe"
echo "$py"
