#!/bin/bash
# On a lent GPU machine: the unit-side GPU checks (`hgxserve gpus check-free` / `wait-free`, the
# ExecStartPre / ExecStopPost of every engine unit) against a real GPU that a process holds, and
# how long the driver takes to free its memory after SIGTERM and after SIGKILL.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
gpus() { python3 -c 'from hgxserve.cli.gpus import gpus; gpus(prog_name="hgxserve gpus")' "$@"; }
now() { date +%s.%N; }
log="$OUT/gpus.txt"
{
echo "## query-gpu (exact argv of hgxserve.gpus.checks.QUERY_GPUS)"
nvidia-smi --query-gpu=index,uuid --format=csv,noheader,nounits; echo "## rc $?"
echo "## query-apps idle (QUERY_APPS)"
nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits; echo "## rc $?"
echo "## check-free idle"; gpus check-free --gpus 0; echo "## rc $?"
for sig in TERM KILL; do
  python3 "$HERE"/h200_check.py hold 40 >/tmp/hold.log 2>&1 &
  holder=$!
  for _ in $(seq 1 240); do grep -q holding /tmp/hold.log && break; sleep 0.25; done
  echo "## query-apps holding 40 GiB (pid $holder)"
  nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits; echo "## rc $?"
  echo "## check-free busy"; gpus check-free --gpus 0; echo "## rc $?"
  echo "## wait-free times out while held"; t0=$(now); gpus wait-free --gpus 0 --timeout 2 --interval 0.2; echo "## rc $? after $(awk "BEGIN{printf \"%.3f\", $(now) - $t0}") s"
  t0=$(now); kill -"$sig" "$holder"
  echo "## wait-free after SIG$sig"; gpus wait-free --gpus 0 --timeout 60 --interval 0.05; echo "## rc $? after $(awk "BEGIN{printf \"%.3f\", $(now) - $t0}") s"
  wait "$holder" 2>/dev/null
done
echo "## check-free on a GPU index that does not exist"; gpus check-free --gpus 7; echo "## rc $?"
} >"$log" 2>&1
cat "$log"
