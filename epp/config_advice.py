"""Warnings about valid configurations that do not do what they appear to.

A configuration can pass validation and still protect nothing: flow control in queue mode
with neither a per-replica limit nor objectives at two priorities releases held requests
whenever the replicas' own queues are short, so critical requests wait behind the batch work
admitted before them; latency targets that neither admission nor a plugin of the selected
profile reads are only counted. ``epp check-config`` prints these (it
still exits 0) and ``epp serve`` logs them at start and on every reload.
"""

from __future__ import annotations

from epp.config import Config
from epp.scheduling import plugin_class
from epp.scheduling.data import LATENCY_TARGET


def advice(config: Config) -> list[str]:
    """One line per way ``config`` cannot do what it names, each with the key to change."""
    out: list[str] = []
    request = config.request
    mode = config.flow_control.mode
    detector = config.admission
    priorities = set(request.objectives.values())
    limited = bool(detector.max_requests or detector.max_tokens)
    if mode == "queue" and not limited and len(priorities) < 2:
        out.append(
            "admission.mode is queue with neither admission.max_requests nor "
            "admission.max_tokens: held requests are released whenever a replica has fewer than "
            f"queue_threshold ({detector.queue_threshold}) waiting and KV below kv_threshold "
            f"({detector.kv_threshold:g}), so critical requests queue behind the batch work "
            "admitted before them; name objectives at two or more priorities in "
            "request.objectives (with ttft_ms targets) so admission keeps room for the higher "
            "ones, or set a per-replica limit and sheddable_reserve (docs/admission.md)"
        )
    elif detector.sheddable_reserve and not (detector.max_requests or detector.max_tokens):
        out.append(
            "admission.sheddable_reserve is set but counts only against admission.max_requests "
            "or admission.max_tokens, and neither is set: nothing is reserved"
        )
    if mode == "off" and len(priorities) > 1:
        out.append(
            "request.objectives give different priorities but admission.mode is off: priority "
            "changes no admission (set admission.mode to shed or queue, docs/admission.md)"
        )
    targets = sorted(name for name, t in request.objective_targets.items() if t)
    learned = mode == "queue" and not limited and len(priorities) > 1
    if targets and not learned and not _reads_latency_targets(config):
        out.append(
            f"request.objectives {', '.join(targets)} set latency targets (ttft_ms/tpot_ms), but "
            f"the selected profile {config.scheduling.profile!r} has no plugin that reads them "
            "(latency-target-filter) and admission does not (queue mode without explicit limits "
            "would): they are only counted in "
            "epp_latency_target_requests_total"
        )
    return out


def _reads_latency_targets(config: Config) -> bool:
    classes = (plugin_class(p.type_name) for p in config.scheduling.selected.plugins)
    return any(
        any(i.key is LATENCY_TARGET for i in cls.consumes) for cls in classes if cls is not None
    )
