#!/usr/bin/env bash
# Start N Flower SuperNodes in the background on this machine, one per data partition, and wait
# until each registered with the SuperLink (its log shows "SuperNode ID: ...").
# Secure mode: --root-certificates CA (TLS) and --auth-keys DIR (SuperNode authentication: the
# node for partition P signs with DIR/node-P, whose .pub must be registered at the SuperLink).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_common.sh"

usage() {
  cat >&2 <<USAGE
usage: $(basename "$0") N SUPERLINK_HOST:PORT [--first-partition K] [--num-partitions M]
                        [--port-base P] [--host HOST] [--node-config 'k=v ...'] [--dir DIR]
                        [--wait SECONDS] [--root-certificates CA [--auth-keys DIR]]
                        [--node-workers] [--ranks-per-node N] [--intra-node ddp|fsdp] [--no-insecure] [-- EXTRA flower-supernode ARGS]

  N                     number of SuperNodes to start here
  SUPERLINK_HOST:PORT   the SuperLink's HTTP port (start_superlink.sh --port, default 8000)
  --first-partition K   partition id of the first node here (default 0): nodes get K..K+N-1
  --num-partitions M    total partitions across all machines (default K+N)
  --port-base P         node i binds its Runtime API to P+i (default 9094)
  --host HOST           Runtime API bind address (default 127.0.0.1; only local processes use it)
  --node-config STR     extra node config appended to "partition-id=.. num-partitions=.."
  --dir DIR             PID file and log directory (default \$FLOWER_RUN_DIR or ./run/flower)
  --wait SECONDS        how long to wait for all nodes to register (default 60; 0: do not wait)
  --root-certificates CA  TLS: verify the SuperLink's certificate with this CA certificate
                        (ca.crt from scripts/generate_certs.py) instead of --insecure; also
                        node config root-certificates=CA, for the gRPC data plane's TLS
  --auth-keys DIR       SuperNode authentication: the node for partition P uses the private key
                        DIR/node-P (--auth-supernode-private-key); DIR/node-P.pub must have been
                        registered (scripts/register_supernodes.sh). Needs --root-certificates
  --node-workers        also start a long-lived node worker per node (python -m lordo_fed.node,
                        socket DIR/node-worker-P.sock, node config node-worker=...): the model,
                        optimizer state and data cursor stay in memory between rounds
  --ranks-per-node N    with --node-workers: each node worker is N ranks under torchrun (one per
                        GPU; gloo on CPU), training as one worker with N times the batch; only its
                        lead rank talks to the server (docs/deployment.md, "Nodes of several GPUs")
  --intra-node W        with --ranks-per-node: ddp (each rank holds the whole model; default) or
                        fsdp (FSDP2: θ, gradients and optimizer state sharded across the ranks)
  --no-insecure         do not pass --insecure (give your own TLS flags after --)
Writes DIR/supernode-<partition>.pid and .log (node-worker-<partition>.* with --node-workers); each node's FLWR_HOME is DIR/supernode-<p>.home
(where the app is installed). Stop with scripts/stop_all.sh --dir DIR.
USAGE
  exit 2
}

[[ $# -ge 2 ]] || usage
n="$1"; superlink="$2"; shift 2
is_uint "$n" && (( n >= 1 )) || { echo "N must be a positive integer: $n" >&2; usage; }
[[ "$superlink" =~ ^[^[:space:]]+:[0-9]+$ ]] || { echo "expected HOST:PORT, got: $superlink" >&2; usage; }
first=0; total=""; port_base=9094; host=127.0.0.1; node_extra=""; wait_s=60
insecure=(--insecure); extra=(); root_certs=""; key_dir=""; node_workers=0; ranks=1; intra=ddp
while [[ $# -gt 0 ]]; do
  case "$1" in
    --first-partition) [[ $# -ge 2 ]] && is_uint "$2" || usage; first="$2"; shift 2 ;;
    --num-partitions) [[ $# -ge 2 ]] && is_uint "$2" || usage; total="$2"; shift 2 ;;
    --port-base) [[ $# -ge 2 ]] && is_uint "$2" || usage; port_base="$2"; shift 2 ;;
    --host) [[ $# -ge 2 ]] || usage; host="$2"; shift 2 ;;
    --node-config) [[ $# -ge 2 ]] || usage; node_extra="$2"; shift 2 ;;
    --dir) [[ $# -ge 2 ]] || usage; FLOWER_RUN_DIR="$2"; shift 2 ;;
    --wait) [[ $# -ge 2 ]] && is_uint "$2" || usage; wait_s="$2"; shift 2 ;;
    --root-certificates) [[ $# -ge 2 ]] || usage; root_certs="$(abs_file "$2")"; shift 2 ;;
    --auth-keys) [[ $# -ge 2 && -d "$2" ]] || { echo "--auth-keys needs a directory" >&2; usage; }
      key_dir="$(cd "$2" && pwd)"; shift 2 ;;
    --node-workers) node_workers=1; shift ;;
    --ranks-per-node) [[ $# -ge 2 ]] && is_uint "$2" && (( $2 >= 1 )) || usage; ranks="$2"; shift 2 ;;
    --intra-node) [[ $# -ge 2 && ( "$2" == ddp || "$2" == fsdp ) ]] || { echo "--intra-node: expected ddp or fsdp" >&2; usage; }
      intra="$2"; shift 2 ;;
    --no-insecure) insecure=(); shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
[[ -n "$total" ]] || total=$((first + n))
(( first + n <= total )) || die "partitions $first..$((first + n - 1)) do not fit --num-partitions $total"
[[ -z "$root_certs" ]] || insecure=(--root-certificates "$root_certs")
[[ -z "$key_dir" || -n "$root_certs" ]] || die "--auth-keys needs --root-certificates (SuperNode authentication needs TLS)"
if [[ -n "$key_dir" ]]; then
  for ((i = 0; i < n; i++)); do
    key="$key_dir/node-$((first + i))"
    [[ -f "$key" && -r "$key" ]] || die "no private key $key for partition $((first + i)) (scripts/generate_certs.py)"
  done
fi
need_cmd flower-supernode
mkdir -p "$FLOWER_RUN_DIR"
dir="$(cd "$FLOWER_RUN_DIR" && pwd)"

pids=(); logs=(); parts=()
for ((i = 0; i < n; i++)); do
  p=$((first + i))
  pidfile="$dir/supernode-$p.pid"; logfile="$dir/supernode-$p.log"
  if [[ -f "$pidfile" ]] && pid_alive "$(cat "$pidfile")"; then
    die "SuperNode for partition $p already running (pid $(cat "$pidfile"))"
  fi
  : >"$logfile"
  node_config="partition-id=$p num-partitions=$total${node_extra:+ $node_extra}"
  # The ClientApp verifies the gRPC data plane's TLS with the same CA (node config key).
  [[ -z "$root_certs" ]] || node_config+=" root-certificates=\"$root_certs\""
  if (( node_workers )); then
    sock="$dir/node-worker-$p.sock"; wpid="$dir/node-worker-$p.pid"
    if [[ -f "$wpid" ]] && pid_alive "$(cat "$wpid")"; then
      die "node worker for partition $p already running (pid $(cat "$wpid"))"
    fi
    : >"$dir/node-worker-$p.log"
    launcher=("${PYTHON:-python}")
    (( ranks == 1 )) || launcher=("${PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node "$ranks")
    worker_pid="$(start_detached "$wpid" "$dir/node-worker-$p.log" "${launcher[@]}" -m lordo_fed.node --listen "unix://$sock" --intra-node "$intra")"
    echo "node worker partition $p: pid $worker_pid, socket $sock, log $dir/node-worker-$p.log"
    node_config+=" node-worker=\"unix://$sock\""
  fi
  auth=(); [[ -z "$key_dir" ]] || auth=(--auth-supernode-private-key "$key_dir/node-$p")
  pid="$(FLWR_HOME="$dir/supernode-$p.home" start_detached "$pidfile" "$logfile" \
    flower-supernode "${insecure[@]}" "${auth[@]}" --superlink "$superlink" \
    --node-config "$node_config" --host "$host" --port $((port_base + i)) "${extra[@]}")"
  pids+=("$pid"); logs+=("$logfile"); parts+=("$p")
  echo "SuperNode partition $p: pid $pid, runtime port $((port_base + i)), log $logfile"
done

(( wait_s > 0 )) || exit 0
deadline=$((SECONDS + wait_s))
for idx in "${!pids[@]}"; do
  until grep -q "SuperNode ID:" "${logs[$idx]}"; do
    if ! pid_alive "${pids[$idx]}"; then
      echo "SuperNode partition ${parts[$idx]} exited${key_dir:+ (refused? node-${parts[$idx]}.pub must be registered: scripts/register_supernodes.sh)}; log ${logs[$idx]}:" >&2
      log_tail "${logs[$idx]}"; exit 1
    fi
    if (( SECONDS >= deadline )); then
      echo "SuperNode partition ${parts[$idx]} not registered after ${wait_s}s (still running," \
           "retrying; is the SuperLink at $superlink up?); log ${logs[$idx]}:" >&2
      log_tail "${logs[$idx]}"; exit 1
    fi
    sleep 0.3
  done
  echo "  partition ${parts[$idx]}: $(grep -o 'SuperNode ID: [0-9]*' "${logs[$idx]}" | tail -n1)"
done
echo "$n SuperNode(s) registered with $superlink"
