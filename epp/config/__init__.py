"""The one YAML file that configures epp: plain frozen data, validated up front.

Each section is a frozen dataclass whose fields declare their keys once (default, range or
choices, reload policy, doc: :mod:`epp.config.schema`); one walk (:mod:`epp.config.walker`)
reads the whole file and reports every problem, each with its key path
(``scheduling.plugins[0].parameters.tokens_per_request: must be an integer >= 1, got 1.5``), in
one :class:`ConfigError`; every profile is checked, selected or not. The reference in
docs/configuration.md is generated from the declarations (``python -m epp.config.reference``).
A :class:`Config` holds no live objects: the router builds the selected profile's plugins from
its specification (:mod:`epp.scheduling.builder`). :data:`SECTIONS` says which sections a reload
applies; :mod:`epp.config.appliers` holds what applies each.

Secrets need not be inline (:mod:`epp.secrets`): each secret key (``server.debug_token``,
``routing.explain_token``, ``store.redis_url``, ``store.redis_username``,
``store.redis_password``) expands ``${NAME}`` from the environment, or is read from the file
its ``_file`` twin names (``store.redis_password_file: /run/secrets/redis/password``; one
trailing newline dropped). ``request.api_keys_file`` names a YAML file holding the
``request.api_keys`` mapping, and every API key expands ``${NAME}`` too. The Redis username
and password are merged into ``store.redis_url`` (which must then carry no password itself).
"""

from collections.abc import Mapping

from epp.config.admission import AdmissionMode, AdmissionScope, FlowControl
from epp.config.file import Config, File, load_config, parse_config, section_policies
from epp.config.pools import ENGINES, EPP_UNREACHABLE, Engine, ModelConfig
from epp.config.request import MAX_API_KEYS_FILE_BYTES
from epp.config.scheduling import DEFAULT_PROFILE, SchedulingConfig
from epp.config.schema import Reload
from epp.config.sections import (
    DEBUG_ACCESS,
    RoutingConfig,
    ScrapeConfig,
    ServerConfig,
    StoreConfig,
    server_problems,
)
from epp.config.walker import ConfigError

# Every top-level section and what a reload does with it, from the schema; the reload logic
# (epp.server) reads only this. Restart-only sections are bound when the process starts:
# listening sockets (server), the state store's connections (store) and the span exporter's
# thread (tracing).
SECTIONS: Mapping[str, Reload] = section_policies()

__all__ = [
    "DEBUG_ACCESS",
    "DEFAULT_PROFILE",
    "ENGINES",
    "EPP_UNREACHABLE",
    "MAX_API_KEYS_FILE_BYTES",
    "SECTIONS",
    "AdmissionMode",
    "AdmissionScope",
    "Config",
    "ConfigError",
    "Engine",
    "File",
    "FlowControl",
    "ModelConfig",
    "Reload",
    "RoutingConfig",
    "SchedulingConfig",
    "ScrapeConfig",
    "ServerConfig",
    "StoreConfig",
    "load_config",
    "parse_config",
    "server_problems",
]
