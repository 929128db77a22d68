#!/usr/bin/env bash
# Start a Flower SuperLink in the background (PID file + log in the run directory) and wait until
# it answers GET /health. One HTTP port carries the Fleet API (SuperNodes), the Control API
# (`flwr run`) and the Runtime API (ServerApp) in flwr 1.41 and 1.42.
# Secure mode: --tls DIR (HTTPS with DIR/ca.crt, server.pem, server.key from
# scripts/generate_certs.py) and --node-auth (only SuperNodes whose public key was registered
# with scripts/register_supernodes.sh may connect); see docs/deployment.md "Secure deployment".
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_common.sh"

usage() {
  cat >&2 <<USAGE
usage: $(basename "$0") [--host HOST] [--port PORT] [--database PATH] [--dir DIR] [--wait SECONDS]
                        [--tls DIR [--node-auth]] [--no-insecure] [-- EXTRA flower-superlink ARGS]

  --host HOST       address to bind (default 127.0.0.1; 0.0.0.0 to accept other machines)
  --port PORT       the SuperLink's single HTTP port (default 8000)
  --database PATH   SQLite state file (default DIR/superlink.db; ':flwr-in-memory:' for none)
  --dir DIR         PID file and log directory (default \$FLOWER_RUN_DIR or ./run/flower)
  --wait SECONDS    how long to wait for /health (default 60)
  --tls DIR         HTTPS: --ssl-ca-certfile DIR/ca.crt --ssl-certfile DIR/server.pem
                    --ssl-keyfile DIR/server.key (scripts/generate_certs.py writes them)
  --node-auth       --enable-supernode-auth (needs --tls): refuse SuperNodes whose public key
                    is not registered (scripts/register_supernodes.sh)
  --no-insecure     do not pass --insecure (give your own TLS flags after --)
Writes DIR/superlink.pid and DIR/superlink.log. Stop it with scripts/stop_all.sh --dir DIR.
USAGE
  exit 2
}

host=127.0.0.1; port=8000; database=""; wait_s=60; insecure=(--insecure); extra=()
tls_dir=""; node_auth=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --host) [[ $# -ge 2 ]] || usage; host="$2"; shift 2 ;;
    --port) [[ $# -ge 2 ]] && is_uint "$2" || usage; port="$2"; shift 2 ;;
    --database) [[ $# -ge 2 ]] || usage; database="$2"; shift 2 ;;
    --dir) [[ $# -ge 2 ]] || usage; FLOWER_RUN_DIR="$2"; shift 2 ;;
    --wait) [[ $# -ge 2 ]] && is_uint "$2" || usage; wait_s="$2"; shift 2 ;;
    --tls) [[ $# -ge 2 ]] || usage; tls_dir="$2"; shift 2 ;;
    --node-auth) node_auth=1; shift ;;
    --no-insecure) insecure=(); shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
ca_file=""
if [[ -n "$tls_dir" ]]; then
  ca_file="$(abs_file "$tls_dir/ca.crt")"
  insecure=(--ssl-ca-certfile "$ca_file" --ssl-certfile "$(abs_file "$tls_dir/server.pem")"
            --ssl-keyfile "$(abs_file "$tls_dir/server.key")")
  if (( node_auth )); then insecure+=(--enable-supernode-auth); fi
elif (( node_auth )); then
  die "--node-auth needs --tls DIR (flower-superlink refuses SuperNode authentication without TLS)"
fi
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
scheme=https; [[ "${insecure[*]}" == --insecure ]] && scheme=http
deadline=$((SECONDS + wait_s))
until http_ok "$scheme://$probe_host:$port/health" "$ca_file"; do
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
if [[ -n "$tls_dir" ]]; then
  echo "  TLS: CA $ca_file; SuperNode authentication $( ((node_auth)) && echo on || echo OFF)"
  if (( node_auth )); then
    echo "  register:   scripts/register_supernodes.sh --superlink <this-host>:$port --root-certificates $ca_file KEY.pub..."
  fi
  echo "  SuperNodes: scripts/start_supernodes.sh N <this-host>:$port --root-certificates ca.crt$( ((node_auth)) && echo ' --auth-keys KEYDIR')"
  echo "  submit:     scripts/submit_run.sh --superlink <this-host>:$port --root-certificates $ca_file --app ."
else
  echo "  SuperNodes: scripts/start_supernodes.sh N <this-host>:$port"
  echo "  submit:     scripts/submit_run.sh --superlink <this-host>:$port --app ."
fi
