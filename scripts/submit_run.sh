#!/usr/bin/env bash
# Submit a Flower run: optionally (re)write a SuperLink connection in $FLWR_HOME/config.toml,
# check the run-config keys (an unknown key is named here; Flower's own refusal names it only in
# the SuperLink's log), then `flwr run APP CONNECTION --stream [--run-config ...]`, log the output,
# and exit non-zero when the run did not finish: `flwr run --stream` exits 0 even when the ServerApp
# raised or when flwr run itself was interrupted, so the run's status is asked of the SuperLink.
# `flwr run` (and the local simulation SuperLink it starts) are in PID files from their start, so
# scripts/stop_all.sh stops them; SIGINT/SIGTERM to this script stops the run and what it started.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_common.sh"

usage() {
  cat >&2 <<USAGE
usage: $(basename "$0") [--superlink HOST:PORT] [--connection NAME] [--app DIR]
                     [--run-config 'k=v ...'] [--federation-config 'k=v ...']
                     [--root-certificates CA.pem] [--timeout SECONDS] [--dir DIR]
                     [--stop-local-superlink] [--checked]
                     [-- EXTRA flwr run ARGS]

  --superlink HOST:PORT   write connection NAME -> this SuperLink (its --port, default 8000) into
                          \$FLWR_HOME/config.toml (insecure unless --root-certificates)
  --connection NAME       SuperLink connection to use (default: deployment; 'local' = simulation)
  --app DIR               Flower app directory (default .)
  --run-config STR        run-config overrides, TOML values: 'num-server-rounds=3 name="x"'
                          (repeatable; or a path to a .toml file)
  --federation-config STR simulation settings (local connection only):
                          'num-supernodes=4 client-resources-num-cpus=1'
  --root-certificates CA  CA certificate of a TLS SuperLink (with --superlink; stored as an
                          absolute path in the connection; see docs/deployment.md "Secure")
  --timeout SECONDS       stop waiting after this long; the run is then stopped (flwr stop)
  --dir DIR               where run logs and PID files go (default \$FLOWER_RUN_DIR or ./run/flower)
  --stop-local-superlink  stop the local simulation SuperLink (and its Ray) when the run ends
  --checked               the run-config strings were checked already (scripts/simulate.sh): not again
\$FLWR_HOME defaults to ~/.flwr (Flower's default).
USAGE
  exit 2
}

superlink=""; connection=deployment; app=.; run_configs=(); run_strings=(); fed_configs=(); root_certs=""
timeout_s=0; extra=(); stop_local=0; checked=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --superlink) [[ $# -ge 2 && "$2" =~ ^[^[:space:]]+:[0-9]+$ ]] || usage; superlink="$2"; shift 2 ;;
    --connection) [[ $# -ge 2 && "$2" =~ ^[A-Za-z0-9_-]+$ ]] || usage; connection="$2"; shift 2 ;;
    --app) [[ $# -ge 2 ]] || usage; app="$2"; shift 2 ;;
    --run-config|-c) [[ $# -ge 2 ]] || usage; run_configs+=(--run-config "$2"); run_strings+=("$2"); shift 2 ;;
    --federation-config) [[ $# -ge 2 ]] || usage; fed_configs+=(--federation-config "$2"); shift 2 ;;
    --root-certificates) [[ $# -ge 2 ]] || usage; root_certs="$(abs_file "$2")"; shift 2 ;;
    --timeout) [[ $# -ge 2 ]] && is_uint "$2" || usage; timeout_s="$2"; shift 2 ;;
    --dir) [[ $# -ge 2 ]] || usage; FLOWER_RUN_DIR="$2"; shift 2 ;;
    --stop-local-superlink) stop_local=1; shift ;;
    --checked) checked=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
[[ -f "$app/pyproject.toml" ]] || die "no pyproject.toml in app directory '$app'"
need_cmd flwr
flwr_bin="$(command -v flwr)"
py="$(dirname "$flwr_bin")/python"; [[ -x "$py" ]] || py=python3
flwr_home="${FLWR_HOME:-$HOME/.flwr}"
# Unknown keys, named with the keys meant, before anything starts (a .toml file is Flower's to read).
if (( ! checked && ${#run_strings[@]} )) && [[ "${run_strings[0]}" != *.toml ]]; then
  "$py" "$HERE/run_config.py" check "$app" "${run_strings[@]}" || exit 2
fi

if [[ -n "$superlink" ]]; then
  # Add/replace [superlink.<connection>] in config.toml, keeping the other connections.
  write_connection "$py" "$flwr_home/config.toml" "$connection" "$superlink" "$root_certs"
fi

mkdir -p "$FLOWER_RUN_DIR"
log="$FLOWER_RUN_DIR/run-$(date +%Y%m%d-%H%M%S)-$$.log"
cmd=("$flwr_bin" run "$app" "$connection" --stream "${run_configs[@]}" "${fed_configs[@]}" "${extra[@]}")
echo "\$ ${cmd[*]}" | tee "$log"
# The connection's address in config.toml. On a fresh FLWR_HOME, flwr writes the file itself on its first
# run: until then the address is unknown, so it is read again when needed (record/stop below).
read_address() {
  "$py" - "$flwr_home/config.toml" "$connection" <<'PY' 2>/dev/null || true
import sys
try:
    import tomllib
except ImportError:
    import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    print(tomllib.load(f).get("superlink", {}).get(sys.argv[2], {}).get("address", ""))
PY
}
address="$(read_address)"
local_pattern="flower-superlink .*--simulation .*--log-file $flwr_home/local-superlink/superlink.log"

run_id() { grep -o 'Successfully started run [0-9]*' "$log" 2>/dev/null | grep -o '[0-9]*$' | head -n1 || true; }
# record_local_superlink: a ':local:' connection makes flwr start a background simulation
# SuperLink (identified by its log file under this FLWR_HOME); its PID goes to a PID file as soon
# as it exists, so that scripts/stop_all.sh finds it while the run is still going.
# Fails while the address is unknown (a fresh FLWR_HOME before flwr wrote config.toml), to be called again.
record_local_superlink() {
  [[ -n "$address" ]] || address="$(read_address)"
  [[ -n "$address" ]] || return 1
  [[ "$address" == :local* ]] || return 0
  local pid
  pid="$(pgrep -f -- "$local_pattern" | head -n1 || true)"
  [[ -n "$pid" ]] && echo "$pid" >"$FLOWER_RUN_DIR/local-superlink.pid"
  [[ -n "$pid" ]]
}
stop_local_superlink() {
  [[ -n "$address" ]] || address="$(read_address)"
  (( stop_local )) && [[ "$address" == :local* ]] || return 0
  record_local_superlink || true
  "$HERE/stop_all.sh" --dir "$FLOWER_RUN_DIR" --only superlink >/dev/null 2>&1 || true
}

flwr_pid=""; interrupted=""
on_signal() {  # SIGINT/SIGTERM to this script: stop the run, flwr run, and what this script started
  interrupted="$1"
  trap '' INT TERM
  local id; id="$(run_id)"
  echo "interrupted ($1): stopping${id:+ run $id}" >&2
  if [[ -n "$id" ]]; then timeout 30 "$flwr_bin" stop "$id" "$connection" >/dev/null 2>&1 || true; fi
  [[ -n "$flwr_pid" ]] && kill -TERM "$flwr_pid" 2>/dev/null || true
  stop_local_superlink
  rm -f "$FLOWER_RUN_DIR/flwr-run.pid"
  [[ "$1" == INT ]] && exit 130
  exit 143
}
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM

if (( timeout_s > 0 )); then cmd=(timeout --kill-after=10 "$timeout_s" "${cmd[@]}"); fi
env --default-signal=INT true 2>/dev/null && cmd=(env --default-signal=INT "${cmd[@]}")
# In the background (with this script's traps in charge), its PID on file from the start. A
# background job of a script starts with SIGINT ignored; `env --default-signal` gives it back, so a
# SIGINT to flwr run alone still ends it (and is then reported as a run that did not finish).
"${cmd[@]}" > >(tee -a "$log") 2>&1 &
flwr_pid=$!
echo "$flwr_pid" >"$FLOWER_RUN_DIR/flwr-run.pid"
recorded=0
while pid_alive "$flwr_pid"; do
  (( recorded )) || { record_local_superlink && recorded=1; } || true
  sleep 0.2
done
status=0; wait "$flwr_pid" || status=$?
rm -f "$FLOWER_RUN_DIR/flwr-run.pid"
sleep 0.2  # tee's last lines
record_local_superlink || true
id="$(run_id)"
# The run's status, from the SuperLink (before a local one is stopped): `flwr run --stream` exits 0
# both when the run finished and when only its log stream ended (a SIGINT to flwr run alone).
run_status=""
if [[ -n "$id" ]] && (( status == 0 )); then
  run_status="$(timeout 30 "$flwr_bin" ls --run-id "$id" "$connection" --format json 2>/dev/null | "$py" -c '
import json, sys
try:
    print(json.load(sys.stdin)["runs"][0]["status"])
except Exception:
    print("")' || true)"
fi
if (( stop_local )); then
  stop_local_superlink
elif [[ -f "$FLOWER_RUN_DIR/local-superlink.pid" ]] && pid_alive "$(cat "$FLOWER_RUN_DIR/local-superlink.pid")"; then
  echo "local simulation SuperLink still running (pid $(cat "$FLOWER_RUN_DIR/local-superlink.pid"));" \
       "stop it with scripts/stop_all.sh --dir $FLOWER_RUN_DIR" >&2
fi
if (( status == 124 )); then
  echo "timed out after ${timeout_s}s" >&2
  if [[ -n "$id" ]]; then
    echo "stopping run $id" >&2
    timeout 60 "$flwr_bin" stop "$id" "$connection" >&2 || true
  fi
  exit 124
fi
(( status == 0 )) || { echo "flwr run failed with exit status $status (log: $log)" >&2; exit "$status"; }
if code="$(grep -o 'Exit Code: [0-9]*' "$log" | grep -v 'Exit Code: 0$' | tail -n1)"; then
  echo "run ${id:-?} failed ($code; log: $log)" >&2
  exit 1
fi
case "$run_status" in
  finished:completed) ;;
  finished:*) echo "run ${id:-?} ended as '$run_status' (log: $log)" >&2; exit 1 ;;
  "") if grep -q 'Exiting logstream' "$log"; then   # the SuperLink did not answer: flwr run's own word
        echo "run ${id:-?} did not finish: flwr run was interrupted (log: $log)" >&2; exit 3
      fi ;;
  *) echo "run ${id:-?} did not finish: flwr run ended while the run was '$run_status'" \
          "(log: $log)$( (( stop_local )) && echo '; the local SuperLink was stopped, and the run with it')" >&2
     exit 3 ;;
esac
echo "run ${id:-?} finished (log: $log)"
