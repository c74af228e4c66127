#!/usr/bin/env bash
# Install the peer routers the routing benchmark compares epp against, each in its own venv under
# .cache/peers/ so their dependencies never touch the project's venv. Idempotent: a venv whose
# stamp matches the pinned version is left alone. A peer that fails to install is reported and
# skipped (exit 0): benchmarks/routing.py then reports it as "unavailable" and runs the rest.
#
# Usage: bash benchmarks/setup_peers.sh [sglang-router] [vllm-router]
set -u
cd "$(dirname "$0")/.."
ROOT="$PWD"
PEERS="$ROOT/.cache/peers"
PYTHON="${PEER_PYTHON:-python3}"
declare -A VERSION=([sglang-router]=0.3.2 [vllm-router]=0.1.17)

install_peer() {
    local name="$1" version="${VERSION[$1]}"
    local venv="$PEERS/$name" stamp="$PEERS/$name/.installed-$version"
    if [[ -f "$stamp" ]]; then
        echo "==> $name $version already installed in $venv"
        return 0
    fi
    echo "==> installing $name $version into $venv"
    rm -rf "$venv"
    if ! "$PYTHON" -m venv "$venv" >"$PEERS/$name.log" 2>&1 ||
        ! "$venv/bin/python" -m pip install -q --disable-pip-version-check \
            "$name==$version" >>"$PEERS/$name.log" 2>&1; then
        echo "!!  $name: install failed, see $PEERS/$name.log (the benchmark will skip it)"
        return 0
    fi
    touch "$stamp"
    echo "==> $name $version ready"
}

mkdir -p "$PEERS"
targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(sglang-router vllm-router)
for peer in "${targets[@]}"; do
    if [[ -z "${VERSION[$peer]:-}" ]]; then
        echo "unknown peer '$peer' (known: ${!VERSION[*]})" >&2
        exit 2
    fi
    install_peer "$peer"
done
