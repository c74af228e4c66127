"""The prefill/decode scheduling profiles the P/D tests share (docs/pd.md's example).

Prompts whose uncached tokens reach ``THRESHOLD`` on the chosen decode replica are split: the
decode side is picked first, then a prefill replica by the ``prefill`` profile.
"""

from __future__ import annotations

from typing import Any

THRESHOLD = 64
PROFILES: dict[str, Any] = {
    "profile": "pd",
    "profiles": {
        "pd": [
            {"plugin": "decode-filter"},
            {"plugin": "prefix-cache-scorer", "weight": 3},
            {"plugin": "queue-scorer", "weight": 1},
            {"plugin": "max-score-picker"},
            {
                "plugin": "prefix-based-pd-decider",
                "parameters": {"non_cached_tokens": THRESHOLD},
            },
        ],
        "prefill": [
            {"plugin": "prefill-filter"},
            {"plugin": "prefix-cache-scorer", "weight": 3},
            {"plugin": "queue-scorer", "weight": 1},
            {"plugin": "max-score-picker"},
        ],
    },
}
