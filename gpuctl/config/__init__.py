"""The configuration (docs/reference/configuration.md): TOML validated at load into frozen
Structs (msgspec).

Everything is validated when the file is loaded, and every error names its location
(``services.vllm.memory: expected a size like '80GiB' ...``). Secrets never live in the
file: a host names an environment variable or a file, read when a token is needed.
The key names are a contract; a rename needs a deprecation path.

Modules: ``values`` (the frozen Structs a config loads into: ``Config``, ``HostConfig``,
``ServiceConfig``…; the one list of probe names), ``table`` (typed, located getters for
one TOML table), ``parse`` (TOML tables to those values), ``load`` (finding and reading
the file), ``secrets`` (tokens), ``paths`` (where config and state live; the one reader
of ``GPUCTL_CONFIG``), ``starter`` (``gpuctl config init``).
"""

from __future__ import annotations

from gpuctl.config.load import load_config
from gpuctl.config.parse import parse_config
from gpuctl.config.paths import config_path
from gpuctl.config.secrets import token_file_warning
from gpuctl.config.values import (
    LAUNCHERS,
    PROBES,
    Config,
    Defaults,
    HostConfig,
    ProbeName,
    ServiceConfig,
    SlurmConfig,
)

__all__ = [
    "LAUNCHERS",
    "PROBES",
    "Config",
    "Defaults",
    "HostConfig",
    "ProbeName",
    "ServiceConfig",
    "SlurmConfig",
    "config_path",
    "load_config",
    "parse_config",
    "token_file_warning",
]
