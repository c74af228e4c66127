#!/usr/bin/env bash
# make test-compose: the docker-compose stack for real, under rootful podman with local images.
#
# Installs what it needs (Debian: podman runc dnsname dnsmasq-base debootstrap; PyPI:
# podman-compose in .cache/compose/venv), writes the containers.conf podman needs on these
# machines (runc, ulimits: crun cannot setrlimit here), builds the images
# (tests/compose/images.sh) and runs tests/compose/check_stack.py, then tests/compose/check_pd.py
# (the stack with docker-compose.pd.yml). Needs root (rootful podman).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE=${EPP_COMPOSE_CACHE:-.cache/compose}
export EPP_COMPOSE_CACHE=$CACHE
mkdir -p "$CACHE"
step() { printf '==> %s\n' "$*"; }
started=$(date +%s)

if [ "$(id -u)" != 0 ]; then
  echo "make test-compose needs root: rootful podman is what runs here (sudo make test-compose)" >&2
  exit 1
fi

need=()
for pkg in podman runc golang-github-containernetworking-plugin-dnsname dnsmasq-base debootstrap; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  step "apt-get install ${need[*]}"
  apt-get update -q > "$CACHE/apt.log" 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >> "$CACHE/apt.log" 2>&1 \
    || { echo "apt-get install failed: see $CACHE/apt.log" >&2; exit 1; }
fi

if [ ! -x "$CACHE/venv/bin/podman-compose" ]; then
  step "pip install podman-compose (into $CACHE/venv)"
  python3 -m venv "$CACHE/venv"
  "$CACHE/venv/bin/pip" install -q 'podman-compose>=1.6' > "$CACHE/pip.log" 2>&1 \
    || { echo "pip install podman-compose failed: see $CACHE/pip.log" >&2; exit 1; }
fi

# crun (podman's default) fails on setrlimit on our machines; runc with explicit ulimits works.
cat > "$CACHE/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]
[engine]
runtime = "runc"
CONF
export CONTAINERS_CONF=$PWD/$CACHE/containers.conf

bash tests/compose/images.sh
step "images ready after $(( $(date +%s) - started )) s"
.venv/bin/python tests/compose/check_stack.py "$CACHE/venv/bin/podman-compose"
step "the P/D overlay (docker-compose.pd.yml)"
.venv/bin/python tests/compose/check_pd.py "$CACHE/venv/bin/podman-compose"
step "make test-compose passed in $(( $(date +%s) - started )) s"
