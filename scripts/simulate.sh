#!/usr/bin/env bash
# The main job: a LoRDO run with Flower's simulation engine on this machine.
#   scripts/simulate.sh                      # 4 virtual clients, preset 'quickstart', shipped corpus
#   scripts/simulate.sh "rank=16 num-server-rounds=8"   # extra run-config overrides
#   NUM_CLIENTS=8 scripts/simulate.sh
# Starts `flwr run . local --stream` (which starts a local simulation SuperLink), then stops that
# SuperLink again, and prints where the metrics, plots and checkpoints are.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
cd "$ROOT"
export FLWR_HOME="${FLWR_HOME:-$ROOT/.flwr}"                 # Flower's state and connections
export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/lordo-ray-$(id -u)}"   # Ray needs a short socket path
export FLOWER_RUN_DIR="${FLOWER_RUN_DIR:-$ROOT/run/flower}"
mkdir -p "$FLWR_HOME" "$RAY_TMPDIR"
out="${OUTPUT_DIR:-$ROOT/outputs/flower}"
clients="${NUM_CLIENTS:-4}"
status=0
"$HERE/submit_run.sh" --connection local \
  --federation-config "num-supernodes=$clients client-resources-num-cpus=1" \
  --run-config "preset='quickstart' output-dir='$out' min-clients=$clients ${1:-}" || status=$?
"$HERE/stop_all.sh" --dir "$FLOWER_RUN_DIR" >/dev/null 2>&1 || true
if (( status == 0 )); then
  echo "metrics: $out/server.jsonl (+ tb/ with tensorboard=true)"
  echo "plots:   $out/val_loss.png, $out/bytes.png"
  echo "checkpoints: $out/checkpoints (resume with --run-config \"resume='$out/checkpoints'\")"
fi
exit "$status"
