"""Where each pool's endpoints come from: a static list, DNS, or a Kubernetes InferencePool.

Every source publishes the full current endpoint set of its pool (:mod:`epp.discovery.source`);
:class:`~epp.discovery.manager.Discovery` runs one source per pool and hands the server a
configuration whose pools hold the latest sets. See docs/discovery.md.
"""

from epp.discovery.manager import Discovery, DiscoveryOptions
from epp.discovery.spec import (
    DiscoverySpec,
    DnsSpec,
    KubernetesSpec,
    StaticSpec,
)

__all__ = [
    "Discovery",
    "DiscoveryOptions",
    "DiscoverySpec",
    "DnsSpec",
    "KubernetesSpec",
    "StaticSpec",
]
