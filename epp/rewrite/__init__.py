"""Model rewrite and weighted splits: the body's ``model`` replaced before scheduling.

One model for both sources (README.md beside this file): rules from the configuration file
(``models.NAME.rewrite``) and from ``InferenceModelRewrite`` resources (:mod:`.kubernetes`)
become :class:`Rule` objects in one :class:`RewriteTable`, which picks each request's target.
"""

from epp.rewrite.rules import (
    ANY_MODEL,
    AcceptedModels,
    Rewrite,
    RewriteTable,
    Rule,
    Target,
    explained,
)

__all__ = ["ANY_MODEL", "AcceptedModels", "Rewrite", "RewriteTable", "Rule", "Target", "explained"]
