#!/usr/bin/env bash
# Register SuperNode public keys with a SuperLink started with --node-auth
# (`flower-superlink --enable-supernode-auth`): one `flwr supernode register KEY.pub CONNECTION`
# per key, then list the nodes. Only a SuperNode whose key is registered can connect; it then
# gets the node id printed here. A key already registered is reported and skipped.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_common.sh"

usage() {
  cat >&2 <<USAGE
usage: $(basename "$0") [--superlink HOST:PORT --root-certificates CA] [--connection NAME]
                        KEY.pub [KEY.pub ...]

  KEY.pub                 a SuperNode's public key (OpenSSH format, NIST EC curve:
                          scripts/generate_certs.py writes nodes/node-<i>.pub)
  --superlink HOST:PORT   write connection NAME -> this SuperLink into \$FLWR_HOME/config.toml
  --root-certificates CA  the CA certificate that signed the SuperLink's (TLS; with --superlink)
  --connection NAME       SuperLink connection to use (default: deployment)
Unregister a node: flwr supernode unregister NODE_ID NAME.  List: flwr supernode list NAME.
\$FLWR_HOME defaults to ~/.flwr (Flower's default).
USAGE
  exit 2
}

superlink=""; root_certs=""; connection=deployment; keys=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --superlink) [[ $# -ge 2 && "$2" =~ ^[^[:space:]]+:[0-9]+$ ]] || usage; superlink="$2"; shift 2 ;;
    --root-certificates) [[ $# -ge 2 ]] || usage; root_certs="$(abs_file "$2")"; shift 2 ;;
    --connection) [[ $# -ge 2 && "$2" =~ ^[A-Za-z0-9_-]+$ ]] || usage; connection="$2"; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "unknown argument: $1" >&2; usage ;;
    *) keys+=("$(abs_file "$1")"); shift ;;
  esac
done
(( ${#keys[@]} > 0 )) || { echo "no public key given" >&2; usage; }
[[ -z "$superlink" || -n "$root_certs" ]] || die "--superlink needs --root-certificates (SuperNode authentication needs TLS)"
need_cmd flwr
flwr_bin="$(command -v flwr)"
py="$(dirname "$flwr_bin")/python"; [[ -x "$py" ]] || py=python3
flwr_home="${FLWR_HOME:-$HOME/.flwr}"
[[ -z "$superlink" ]] || write_connection "$py" "$flwr_home/config.toml" "$connection" "$superlink" "$root_certs"

failed=0
for key in "${keys[@]}"; do
  out="$("$flwr_bin" supernode register "$key" "$connection" --format json 2>&1)" || true
  node_id="$(printf '%s\n' "$out" | grep -o '"node-id": *"\?[0-9]*' | grep -o '[0-9]*$' || true)"
  if [[ -n "$node_id" ]]; then
    echo "registered $key: node id $node_id"
  elif grep -q "Public key already in use" <<<"$out"; then
    echo "already registered: $key"
  else
    echo "failed to register $key:" >&2
    printf '%s\n' "$out" | sed 's/^/    /' >&2
    failed=1
  fi
done
"$flwr_bin" supernode list "$connection" || failed=1
exit "$failed"
