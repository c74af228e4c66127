"""Envoy's view of the fleet as a file: epp writes the ``pool`` cluster's endpoints where
Envoy's file-based EDS reads them (``epp envoy-config --eds-dir``; docs/discovery.md says why
a file and not gRPC xDS).

The file is a DiscoveryResponse with one ClusterLoadAssignment holding every endpoint of every
pool. It is written to a temporary name in the same directory and renamed over ``pool.yaml``:
Envoy's ``watched_directory`` reacts to the move and never reads a half-written file. The
content depends only on the endpoint set (``version_info`` is its hash), so several epp
processes writing the same directory produce the same bytes, and a rewrite of an unchanged set
is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "pool.yaml"
ASSIGNMENT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def eds_path(directory: str | Path) -> Path:
    return Path(directory) / FILE_NAME


def discovery_response(cluster: str, pools: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    endpoints = sorted({addr for addrs in pools.values() for addr in addrs})
    lb_endpoints = []
    for addr in endpoints:
        host, _, port = addr.rpartition(":")
        socket = {"address": host.strip("[]"), "port_value": int(port)}
        lb_endpoints.append({"endpoint": {"address": {"socket_address": socket}}})
    assignment = {
        "@type": ASSIGNMENT_TYPE,
        "cluster_name": cluster,
        "endpoints": [{"lb_endpoints": lb_endpoints}],
    }
    digest = hashlib.sha256(json.dumps(assignment, sort_keys=True).encode()).hexdigest()[:16]
    return {"version_info": digest, "resources": [assignment]}


class EdsFile:
    def __init__(self, directory: str | Path, cluster: str) -> None:
        self.path = eds_path(directory)
        self._cluster = cluster
        self._written: str | None = None

    def write(self, pools: Mapping[str, tuple[str, ...]]) -> bool:
        """Publish ``pools`` to Envoy; False if the file already said the same."""
        # JSON is YAML: Envoy reads the .yaml file either way, and json.dumps is stable.
        text = json.dumps(discovery_response(self._cluster, pools), indent=1) + "\n"
        if text == self._written:
            return False
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        self._written = text
        log.debug("EDS file %s: %d endpoints", self.path, text.count('"socket_address"'))
        return True
