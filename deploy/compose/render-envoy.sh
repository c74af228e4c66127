#!/usr/bin/env sh
# Render deploy/compose/envoy.yaml from deploy/compose/epp.yaml: Envoy listens on 8080 in its
# container and talks to both epp services by name. Run after changing epp.yaml or epp's Envoy
# rendering; tests/unit/test_deploy_compose.py fails while the committed file is stale.
#   deploy/compose/render-envoy.sh [OUTPUT]    (default: deploy/compose/envoy.yaml)
set -eu
here=$(dirname "$0")
python=${PYTHON:-$here/../../.venv/bin/python}
# epp.yaml reads Redis' password from the environment; Envoy's configuration does not use it.
EPP_REDIS_PASSWORD=${EPP_REDIS_PASSWORD:-not-needed-by-envoy-config} exec "$python" -m epp envoy-config --config "$here/epp.yaml" \
  --listen 0.0.0.0:8080 --admin 0.0.0.0:9901 \
  --extproc epp-1:9002 --extproc epp-2:9002 --health epp-1:9003 --health epp-2:9003 \
  -o "${1:-$here/envoy.yaml}"
