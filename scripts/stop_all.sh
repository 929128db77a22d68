#!/usr/bin/env bash
# Stop the SuperLink / SuperNodes started by start_superlink.sh / start_supernodes.sh, and the
# `flwr run` and local simulation SuperLink that submit_run.sh recorded when they started: only the
# processes named in DIR/*.pid (and their child processes), SIGTERM first, SIGKILL after a bound.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_common.sh"

usage() {
  cat >&2 <<USAGE
usage: $(basename "$0") [--dir DIR] [--timeout SECONDS] [--only superlink|supernodes]

  --dir DIR          directory with the PID files (default \$FLOWER_RUN_DIR or ./run/flower)
  --timeout SECONDS  grace period after SIGTERM before SIGKILL (default 15)
  --only WHAT        stop only the SuperLink or only the SuperNodes
USAGE
  exit 2
}

timeout_s=15; only=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) [[ $# -ge 2 ]] || usage; FLOWER_RUN_DIR="$2"; shift 2 ;;
    --timeout) [[ $# -ge 2 ]] && is_uint "$2" || usage; timeout_s="$2"; shift 2 ;;
    --only) [[ $# -ge 2 && ( "$2" == superlink || "$2" == supernodes ) ]] || usage; only="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
[[ -d "$FLOWER_RUN_DIR" ]] || { echo "nothing to stop: no directory $FLOWER_RUN_DIR"; exit 0; }

shopt -s nullglob
case "$only" in
  superlink) pidfiles=("$FLOWER_RUN_DIR"/superlink.pid "$FLOWER_RUN_DIR"/local-superlink.pid) ;;
  supernodes) pidfiles=("$FLOWER_RUN_DIR"/supernode-*.pid "$FLOWER_RUN_DIR"/node-worker-*.pid) ;;
  *) pidfiles=("$FLOWER_RUN_DIR"/flwr-run.pid "$FLOWER_RUN_DIR"/superlink.pid "$FLOWER_RUN_DIR"/local-superlink.pid
      "$FLOWER_RUN_DIR"/supernode-*.pid "$FLOWER_RUN_DIR"/node-worker-*.pid) ;;
esac

# descendants PID...: all live descendants (SuperExec, ServerApp/ClientApp processes). The
# SuperLink starts its SuperExec in a new session, so the process group alone is not enough.
descendants() {
  local pid child
  for pid in "$@"; do
    for child in $(pgrep -P "$pid" 2>/dev/null || true); do
      echo "$child"; descendants "$child"
    done
  done
}

roots=(); victims=(); stale=()
for f in "${pidfiles[@]}"; do
  [[ -f "$f" ]] || continue
  pid="$(tr -dc '0-9' <"$f")"
  name="$(basename "$f" .pid)"
  expect=flower-supernode; [[ "$name" == *superlink ]] && expect=flower-superlink; [[ "$name" == node-worker-* ]] && expect=lordo_fed.node
  [[ "$name" == flwr-run ]] && expect="flwr run"
  if [[ -z "$pid" ]] || ! pid_alive "$pid"; then
    echo "$name: not running"; stale+=("$f"); continue
  fi
  if ! pid_cmd_matches "$pid" "$expect"; then
    echo "$name: pid $pid is not $expect any more (PID reused?); leaving it alone" >&2
    stale+=("$f"); continue
  fi
  echo "$name: stopping pid $pid"
  roots+=("$pid"); victims+=("$pid")
done
(( ${#stale[@]} == 0 )) || rm -f "${stale[@]}"
(( ${#roots[@]} > 0 )) || { echo "nothing to stop"; exit 0; }
while read -r child; do [[ -n "$child" ]] && victims+=("$child"); done < <(descendants "${roots[@]}")

for pid in "${roots[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done   # group (setsid)
for pid in "${victims[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done

deadline=$((SECONDS + timeout_s))
while :; do
  left=()
  for pid in "${victims[@]}"; do pid_alive "$pid" && left+=("$pid"); done
  (( ${#left[@]} == 0 )) && break
  if (( SECONDS >= deadline )); then
    echo "still running after ${timeout_s}s, SIGKILL: ${left[*]}" >&2
    for pid in "${roots[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
    for pid in "${left[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    sleep 1
    left2=()
    for pid in "${left[@]}"; do pid_alive "$pid" && left2+=("$pid"); done
    (( ${#left2[@]} == 0 )) || { echo "could not stop: ${left2[*]}" >&2; exit 1; }
    break
  fi
  sleep 0.2
done
for f in "${pidfiles[@]}"; do [[ -f "$f" ]] && rm -f "$f"; done
echo "stopped ${#victims[@]} process(es)"
