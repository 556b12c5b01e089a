"""Find, read and validate the config: the one way every command and the API load it."""

from __future__ import annotations

from pathlib import Path

import msgspec

from gpuctl.config.parse import parse_config
from gpuctl.config.paths import config_path
from gpuctl.config.secrets import token_file_warning
from gpuctl.config.values import Config
from gpuctl.errors import ConfigError


def load_config(explicit: Path | None = None) -> Config:
    """Load the config from ``explicit`` (``--config``), else ``$GPUCTL_CONFIG``, else the
    user config dir (``~/.config/gpuctl/config.toml`` on Linux).

    A missing default file is an empty config (no hosts, no services: ``status`` probes
    this machine). A file the user named must exist. Token files that others can read
    come back as ``Config.warnings``.

    Raises:
        ConfigError: the file cannot be read or parsed, or a value is wrong; the message
            names the location.
    """
    path, named = config_path(explicit)
    from gpuctl.config.readfile import CONFIG_LIMIT, NotSmallFile, read_small

    try:
        raw = read_small(path, CONFIG_LIMIT)
    except NotSmallFile as e:
        raise ConfigError(
            f"config file {e}", hint="point GPUCTL_CONFIG / --config at the config file"
        ) from None
    except FileNotFoundError:
        if named:
            raise ConfigError(
                f"config file {path} does not exist",
                hint="create it with `gpuctl config init`, or drop --config / GPUCTL_CONFIG",
            ) from None
        return Config(path=path)
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a file") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    import tomllib  # about 10 ms: only when there is a file to read

    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}", hint="fix the line it names") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: nested too deeply") from None
    conf = parse_config(data, path)
    warnings: list[str] = []
    for h in conf.hosts.values():
        for f in (h.token_file, h.read_token_file, h.jupyter_token_file):
            if f is not None:
                w = token_file_warning(f)
                if w:
                    warnings.append(f"hosts.{h.name}: {w}")
    if not warnings:
        return conf
    # Replace, never rebuild field by field: a rebuild once dropped [proxy] (its listen
    # address and client keys fell back to the defaults) whenever a token file warned.
    return msgspec.structs.replace(conf, warnings=(*conf.warnings, *warnings))
