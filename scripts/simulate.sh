#!/usr/bin/env bash
# The main job: a LoRDO run with Flower's simulation engine on this machine. `--help` for usage.
# Runs `flwr run . local --stream` through scripts/submit_run.sh (which checks the keys, records
# the PIDs, stops the local SuperLink it starts, and fails when the run did not finish), then says
# where the metrics, plots and checkpoints are, or which round an interrupted run reached and the
# command that resumes it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"

usage() {
  cat <<USAGE
usage: $(basename "$0") [RUN-CONFIG ...] [--run-config RUN-CONFIG ...]

  RUN-CONFIG   run-config keys as flwr run takes them, TOML values: 'num-server-rounds=8 rank=16'
               or "preset='paper-16m'" (any key of pyproject.toml's [tool.flwr.app.config];
               several arguments are merged, a later one wins). They are merged over this
               script's defaults, and any key given wins:
                 preset='quickstart' output-dir='\$OUTPUT_DIR' min-clients=\$NUM_CLIENTS
  -h, --help   this text; nothing runs

environment: NUM_CLIENTS (virtual clients, default 4), OUTPUT_DIR (default outputs/flower),
             FLWR_HOME (default .flwr), FLOWER_RUN_DIR (PID files and logs, default run/flower)

examples:
  $(basename "$0")                                  # 4 clients, preset 'quickstart', shipped corpus
  $(basename "$0") num-server-rounds=8 rank=16
  $(basename "$0") "preset='paper-16m'" "output-dir='outputs/p16m'"
  $(basename "$0") "resume='outputs/flower/checkpoints'"   # continue a run (the same settings)

One run per output directory: a new run into a directory that holds another run's checkpoints is
refused (resume it, or give another output-dir), before Flower starts, and so is a resume with other
settings; a finished run resumed says "nothing to do". Exit status: 0 when the run finished (or had
nothing to do), 2 when it was refused, other non-zero when it failed or was interrupted (then the
round it reached and the resume command are printed).
USAGE
}

strings=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --run-config|-c) [[ $# -ge 2 ]] || { usage >&2; exit 2; }; strings+=("$2"); shift 2 ;;
    -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
    *) strings+=("$1"); shift ;;
  esac
done

cd "$ROOT"
export FLWR_HOME="${FLWR_HOME:-$ROOT/.flwr}"                 # Flower's state and connections
export RAY_TMPDIR="${RAY_TMPDIR:-/tmp/lordo-ray-$(id -u)}"   # Ray needs a short socket path
export FLOWER_RUN_DIR="${FLOWER_RUN_DIR:-$ROOT/run/flower}"
mkdir -p "$FLWR_HOME" "$RAY_TMPDIR"
clients="${NUM_CLIENTS:-4}"
defaults="preset='quickstart' output-dir='${OUTPUT_DIR:-$ROOT/outputs/flower}' min-clients=$clients"
py="$(command -v python || command -v python3)"
# The run's output directory as the ServerApp will see it: the defaults, then every string given.
out="$("$py" "$HERE/run_config.py" get output-dir "$defaults" "${strings[@]}")" || exit 2
[[ "$out" == /* ]] || out="$ROOT/$out"

# The keys and values, then the output-dir and resume as the ServerApp checks them (it writes on this
# machine): a refused run, or a finished one resumed, is told before Flower and Ray start.
check=0; "$py" "$HERE/run_config.py" check --local "$ROOT" "$defaults" "${strings[@]}" || check=$?
case "$check" in 0) ;; 4) exit 0 ;; *) exit 2 ;; esac

run_configs=(--run-config "$defaults")
for s in "${strings[@]}"; do run_configs+=(--run-config "$s"); done
started="$(date +%s)"
status=0; signal=""
# In the background, so that a SIGINT/SIGTERM to this script alone reaches submit_run.sh, which
# stops the run and everything it started (a background job starts with SIGINT ignored: TERM it).
"$HERE/submit_run.sh" --connection local --stop-local-superlink --checked \
  --federation-config "num-supernodes=$clients client-resources-num-cpus=1" "${run_configs[@]}" &
child=$!
trap 'signal=INT; kill -TERM "$child" 2>/dev/null || true' INT
trap 'signal=TERM; kill -TERM "$child" 2>/dev/null || true' TERM
while :; do
  wait "$child" && status=0 || status=$?
  kill -0 "$child" 2>/dev/null || break   # wait returned for a trapped signal: the child is still cleaning up
done
trap - INT TERM
case "$signal" in INT) status=130 ;; TERM) status=143 ;; esac

# run.json (written by the ServerApp) says how far this run got; an older one is another run's.
report="$("$py" - "$out/run.json" "$started" <<'PY'
import json, os, sys
path, started = sys.argv[1], int(sys.argv[2])
try:
    if os.stat(path).st_mtime < started:
        raise FileNotFoundError
    doc = json.load(open(path))
except (OSError, ValueError):
    print("none"); sys.exit()
print(doc.get("status", "?"), doc.get("round", 0), doc.get("num_rounds", "?"), doc.get("resume") or "-")
PY
)"
read -r run_status reached total resume <<<"$report"
resume_cmd=""
if [[ "$resume" != "-" && -n "$resume" ]]; then
  resume_cmd="scripts/simulate.sh"
  for s in "${strings[@]}"; do
    [[ "$s" =~ ^[[:space:]]*resume= ]] && continue   # the old resume value: replaced below
    resume_cmd+=" $(printf '%q' "$s")"
  done
  resume_cmd+=" $(printf '%q' "resume='$resume'")"
fi

if (( status == 0 )) && [[ "$run_status" == finished ]]; then
  echo "metrics: $out/server.jsonl (+ tb/ with tensorboard=true)"
  echo "plots:   $out/val_loss.png, $out/bytes.png"
  echo "checkpoints: $out/checkpoints (to train further: raise num-server-rounds and resume:"
  echo "  ${resume_cmd:-scripts/simulate.sh \"resume='$out/checkpoints'\"})"
  exit 0
fi
(( status != 0 )) || status=1
if [[ "$run_status" == none ]]; then
  echo "the run did not start training (exit status $status): see the messages above" >&2
else
  echo "the run did not finish (exit status $status, status '$run_status'): it reached round $reached of $total" >&2
  if [[ -n "$resume_cmd" ]]; then
    echo "resume it with: $resume_cmd" >&2
  fi
fi
exit "$status"
