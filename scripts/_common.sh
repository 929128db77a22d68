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

# http_ok URL [CAFILE]: GET answers 2xx. With CAFILE, an https URL must present a certificate
# signed by that CA for the host in URL; without, https is not verified (readiness probe only).
http_ok() {
  if command -v curl >/dev/null 2>&1; then
    if [[ -n "${2:-}" ]]; then
      curl -sf --cacert "$2" -o /dev/null --max-time 1 "$1"
    else
      curl -skf -o /dev/null --max-time 1 "$1"
    fi
  else
    python3 - "$1" "${2:-}" <<'PY' >/dev/null 2>&1
import ssl, sys, urllib.request
url, cafile = sys.argv[1], sys.argv[2]
if cafile:
    ctx = ssl.create_default_context(cafile=cafile)
else:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
sys.exit(0 if urllib.request.urlopen(url, timeout=1, context=ctx).status < 300 else 1)
PY
  fi
}

# abs_file PATH: PATH as an absolute path; dies when it is not a readable file.
abs_file() {
  [[ -f "$1" && -r "$1" ]] || die "not a readable file: $1"
  echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
}

# write_connection PYTHON CONFIG_TOML NAME HOST:PORT [ROOT_CERTIFICATES]: add or replace the
# SuperLink connection [superlink.NAME] in Flower's config.toml, keeping the other connections:
# `root-certificates = "<CA>"` (TLS) when a CA file is given, `insecure = true` otherwise.
write_connection() {
  "$1" - "$2" "$3" "$4" "${5:-}" <<'PY'
import sys
from pathlib import Path
try:
    import tomllib
except ImportError:
    import tomli as tomllib
path, name, address, certs = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
doc = tomllib.loads(path.read_text()) if path.exists() else {}
links = doc.get("superlink", {})
links.setdefault("local", {"address": ":local:"})
links[name] = {"address": address, **({"root-certificates": certs} if certs else {"insecure": True})}
links.setdefault("default", "local")
def val(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
def table(prefix, d, out):
    for k, v in d.items():
        if isinstance(v, dict):
            table(f"{prefix}{k}.", v, out)
        else:
            out.append(f"{prefix}{k} = {val(v)}")
lines = ["[superlink]", f"default = {val(links.pop('default'))}"]
for conn, body in links.items():
    lines += ["", f"[superlink.{conn}]"]
    table("", body, lines)
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text("\n".join(lines) + "\n")
print(f"connection '{name}' -> {address} ({'TLS, CA ' + certs if certs else 'insecure'}) written to {path}")
PY
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
