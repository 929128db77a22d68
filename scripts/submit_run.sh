#!/usr/bin/env bash
# Submit a Flower run: optionally (re)write a SuperLink connection in $FLWR_HOME/config.toml,
# then `flwr run APP CONNECTION --stream [--run-config ...]`, log the output, and exit non-zero
# when the run failed (`flwr run --stream` itself exits 0 even when the ServerApp raised).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_common.sh"

usage() {
  cat >&2 <<USAGE
usage: $(basename "$0") [--superlink HOST:PORT] [--connection NAME] [--app DIR]
                     [--run-config 'k=v ...'] [--federation-config 'k=v ...']
                     [--root-certificates CA.pem] [--timeout SECONDS] [--dir DIR]
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
  --dir DIR               where run logs go (default \$FLOWER_RUN_DIR or ./run/flower)
\$FLWR_HOME defaults to ~/.flwr (Flower's default).
USAGE
  exit 2
}

superlink=""; connection=deployment; app=.; run_configs=(); fed_configs=(); root_certs=""
timeout_s=0; extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --superlink) [[ $# -ge 2 && "$2" =~ ^[^[:space:]]+:[0-9]+$ ]] || usage; superlink="$2"; shift 2 ;;
    --connection) [[ $# -ge 2 && "$2" =~ ^[A-Za-z0-9_-]+$ ]] || usage; connection="$2"; shift 2 ;;
    --app) [[ $# -ge 2 ]] || usage; app="$2"; shift 2 ;;
    --run-config|-c) [[ $# -ge 2 ]] || usage; run_configs+=(--run-config "$2"); shift 2 ;;
    --federation-config) [[ $# -ge 2 ]] || usage; fed_configs+=(--federation-config "$2"); shift 2 ;;
    --root-certificates) [[ $# -ge 2 ]] || usage; root_certs="$(abs_file "$2")"; shift 2 ;;
    --timeout) [[ $# -ge 2 ]] && is_uint "$2" || usage; timeout_s="$2"; shift 2 ;;
    --dir) [[ $# -ge 2 ]] || usage; FLOWER_RUN_DIR="$2"; shift 2 ;;
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

if [[ -n "$superlink" ]]; then
  # Add/replace [superlink.<connection>] in config.toml, keeping the other connections.
  write_connection "$py" "$flwr_home/config.toml" "$connection" "$superlink" "$root_certs"
fi

mkdir -p "$FLOWER_RUN_DIR"
log="$FLOWER_RUN_DIR/run-$(date +%Y%m%d-%H%M%S)-$$.log"
cmd=("$flwr_bin" run "$app" "$connection" --stream "${run_configs[@]}" "${fed_configs[@]}" "${extra[@]}")
echo "\$ ${cmd[*]}" | tee "$log"
status=0
if (( timeout_s > 0 )); then
  timeout --kill-after=10 "$timeout_s" "${cmd[@]}" 2>&1 | tee -a "$log" || status=$?
else
  "${cmd[@]}" 2>&1 | tee -a "$log" || status=$?
fi
run_id="$(grep -o 'Successfully started run [0-9]*' "$log" | grep -o '[0-9]*$' | head -n1 || true)"
# A ':local:' connection makes flwr start a background simulation SuperLink that keeps running:
# record its PID so that scripts/stop_all.sh stops it (it is identified by its log file path,
# which lies under this FLWR_HOME).
address="$("$py" - "$flwr_home/config.toml" "$connection" <<'PY' 2>/dev/null || true
import sys
try:
    import tomllib
except ImportError:
    import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    print(tomllib.load(f).get("superlink", {}).get(sys.argv[2], {}).get("address", ""))
PY
)"
if [[ "$address" == :local* ]]; then
  local_pid="$(pgrep -f -- "flower-superlink .*--simulation .*--log-file $flwr_home/local-superlink/superlink.log" | head -n1 || true)"
  if [[ -n "$local_pid" ]]; then
    echo "$local_pid" >"$FLOWER_RUN_DIR/local-superlink.pid"
    echo "local simulation SuperLink still running (pid $local_pid, port ${FLWR_LOCAL_SUPERLINK_HTTP_API_PORT:-39091});" \
         "stop it with scripts/stop_all.sh --dir $FLOWER_RUN_DIR" >&2
  fi
fi
if (( status == 124 )); then
  echo "timed out after ${timeout_s}s" >&2
  if [[ -n "$run_id" ]]; then
    echo "stopping run $run_id" >&2
    timeout 60 "$flwr_bin" stop "$run_id" "$connection" >&2 || true
  fi
  exit 124
fi
(( status == 0 )) || { echo "flwr run failed with exit status $status (log: $log)" >&2; exit "$status"; }
if code="$(grep -o 'Exit Code: [0-9]*' "$log" | grep -v 'Exit Code: 0$' | tail -n1)"; then
  echo "run ${run_id:-?} failed ($code; log: $log)" >&2
  exit 1
fi
echo "run ${run_id:-?} finished (log: $log)"
