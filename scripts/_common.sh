# Sourced by the lordo-fed Flower scripts (not executable on its own).
# Environment every Flower process needs on these machines; a value already set wins.
export FLWR_TELEMETRY_ENABLED="${FLWR_TELEMETRY_ENABLED:-0}"          # no telemetry (offline)
export FLWR_DISABLE_UPDATE_CHECK="${FLWR_DISABLE_UPDATE_CHECK:-1}"    # no PyPI version check
# Otherwise every run `uv sync`s the app's dependencies: fails offline, pulls CUDA torch.
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="${FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION:-1}"
# How often each flower-superexec (one per SuperNode, one per SuperLink) looks for a ClientApp /
# ServerApp to launch; Flower's default of 1 s adds ~0.5 s per message and per run start.
export FLWR_SUPEREXEC_TASK_POLL_INTERVAL="${FLWR_SUPEREXEC_TASK_POLL_INTERVAL:-0.1}"
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"                      # logs appear as they happen
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"        # simulation only
# State directory for PID files and logs (override with --dir or FLOWER_RUN_DIR).
FLOWER_RUN_DIR="${FLOWER_RUN_DIR:-$PWD/run/flower}"

die() { echo "error: $*" >&2; exit 2; }

need_cmd() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found on PATH (activate the venv: . .venv/bin/activate)"; }

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# pid_alive PID: the process exists and is not a zombie.
pid_alive() {
  local state
  [[ -r "/proc/$1/stat" ]] || return 1
  state="$(sed -E 's/^.*\) ([A-Z]).*$/\1/' "/proc/$1/stat" 2>/dev/null)" || return 1
  [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

# pid_cmd_matches PID PATTERN: its command line contains PATTERN (guards against PID reuse).
pid_cmd_matches() {
  [[ -r "/proc/$1/cmdline" ]] && tr '\0' ' ' <"/proc/$1/cmdline" | grep -q -- "$2"
}

# http_ok URL: GET answers 2xx.
http_ok() {
  if command -v curl >/dev/null 2>&1; then
    curl -skf -o /dev/null --max-time 1 "$1"  # -k: readiness probe only
  else
    python3 - "$1" <<'PY' >/dev/null 2>&1
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=1).status < 300 else 1)
PY
  fi
}

# start_detached PIDFILE LOGFILE CMD...: run CMD in a new session (PGID = PID), stdin closed,
# output appended to LOGFILE, PID written to PIDFILE; prints the PID.
start_detached() {
  local pidfile="$1" logfile="$2" pid
  shift 2
  echo "\$ $*" >>"$logfile"
  # In a non-interactive shell a background job is not a group leader, so setsid does not fork:
  # $! is the PID of the Flower process itself.
  setsid "$@" </dev/null >>"$logfile" 2>&1 &
  pid=$!
  echo "$pid" >"$pidfile"
  echo "$pid"
}

# log_tail FILE: last lines of a log, indented.
log_tail() { tail -n "${2:-25}" "$1" 2>/dev/null | sed 's/^/    /' >&2 || true; }
