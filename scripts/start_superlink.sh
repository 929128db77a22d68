#!/usr/bin/env bash
# Start a Flower SuperLink in the background (PID file + log in the run directory) and wait until
# it answers GET /health. One HTTP port carries the Fleet API (SuperNodes), the Control API
# (`flwr run`) and the Runtime API (ServerApp) in flwr 1.41.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_common.sh"

usage() {
  cat >&2 <<USAGE
usage: $(basename "$0") [--host HOST] [--port PORT] [--database PATH] [--dir DIR] [--wait SECONDS]
                        [--no-insecure] [-- EXTRA flower-superlink ARGS]

  --host HOST       address to bind (default 127.0.0.1; 0.0.0.0 to accept other machines)
  --port PORT       the SuperLink's single HTTP port (default 8000)
  --database PATH   SQLite state file (default DIR/superlink.db; ':flwr-in-memory:' for none)
  --dir DIR         PID file and log directory (default \$FLOWER_RUN_DIR or ./run/flower)
  --wait SECONDS    how long to wait for /health (default 60)
  --no-insecure     do not pass --insecure (give TLS flags after --; see the TLS docs)
Writes DIR/superlink.pid and DIR/superlink.log. Stop it with scripts/stop_all.sh --dir DIR.
USAGE
  exit 2
}

host=127.0.0.1; port=8000; database=""; wait_s=60; insecure=(--insecure); extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --host) [[ $# -ge 2 ]] || usage; host="$2"; shift 2 ;;
    --port) [[ $# -ge 2 ]] && is_uint "$2" || usage; port="$2"; shift 2 ;;
    --database) [[ $# -ge 2 ]] || usage; database="$2"; shift 2 ;;
    --dir) [[ $# -ge 2 ]] || usage; FLOWER_RUN_DIR="$2"; shift 2 ;;
    --wait) [[ $# -ge 2 ]] && is_uint "$2" || usage; wait_s="$2"; shift 2 ;;
    --no-insecure) insecure=(); shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
need_cmd flower-superlink
mkdir -p "$FLOWER_RUN_DIR"
dir="$(cd "$FLOWER_RUN_DIR" && pwd)"
pidfile="$dir/superlink.pid"; logfile="$dir/superlink.log"
[[ -n "$database" ]] || database="$dir/superlink.db"

if [[ -f "$pidfile" ]] && pid_alive "$(cat "$pidfile")"; then
  die "a SuperLink is already running (pid $(cat "$pidfile"), $pidfile)"
fi

pid="$(start_detached "$pidfile" "$logfile" flower-superlink "${insecure[@]}" \
  --host "$host" --port "$port" --database "$database" \
  --disable-runtime-dependency-installation "${extra[@]}")"

probe_host="$host"
[[ "$probe_host" == "0.0.0.0" || "$probe_host" == "::" ]] && probe_host=127.0.0.1
scheme=http; [[ ${#insecure[@]} -eq 0 ]] && scheme=https
deadline=$((SECONDS + wait_s))
until http_ok "$scheme://$probe_host:$port/health"; do
  if ! pid_alive "$pid"; then
    echo "flower-superlink exited; log $logfile:" >&2; log_tail "$logfile"; rm -f "$pidfile"; exit 1
  fi
  if (( SECONDS >= deadline )); then
    echo "SuperLink not healthy after ${wait_s}s (still running, pid $pid); log $logfile:" >&2
    log_tail "$logfile"; exit 1
  fi
  sleep 0.3
done
echo "SuperLink running: pid $pid, $scheme://$host:$port (Fleet + Control + Runtime API)"
echo "  log: $logfile"
echo "  SuperNodes: scripts/start_supernodes.sh N <this-host>:$port"
echo "  submit:     scripts/submit_run.sh --superlink <this-host>:$port --app ."
