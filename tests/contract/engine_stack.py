"""epp and a real Envoy in front of real vLLM servers (the contract tier's engines).

:class:`epp.devstack.Stack` starts simulators; here the engines are started by the contract
fixtures (vllm_server.py), so the stack only writes the configurations and runs epp, Envoy
and whatever else a test spawns into it (``epp pd-sidecar``), and stops them.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

from epp.devstack import Stack


class EngineStack(Stack):
    def start_sims(self) -> None:
        """The engines are real and already running."""


def engine_stack(workdir: Path, endpoints: list[str], config: dict[str, Any]) -> EngineStack:
    """A stack whose pool ``main`` is ``endpoints`` (what it waits to see ready), with
    ``config`` laid over the stack's configuration."""
    stack = EngineStack(workdir, replicas=len(endpoints), config_extra=config)
    stack.replica_addresses = list(endpoints)
    return stack


def counter(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` at ``url``/metrics whose labels include ``labels``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total
