"""A TOML table under validation: typed getters that name the location of every error.

Each table declares its keys, and unknown ones are refused before any value is read, so
a typo is reported as the typo. Every getter checks what its value will be used for:
strings without NUL, URLs that parse and name a host, sizes and durations that are
finite and positive.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpuctl.core.units import parse_duration_s, parse_size_mib
from gpuctl.errors import ConfigError

# Schemes whose address is a local path (unix:///var/run/docker.sock), not a host.
_PATH_SCHEMES = ("unix", "npipe")
# An environment variable name as a shell writes it (the Jupyter launcher exports them).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)


class Table:
    """A TOML table being validated: typed getters that name the location of each value."""

    def __init__(self, where: str, data: Any, keys: tuple[str, ...]) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a table, got {tname(data)}")
        self.where = where
        self.data: dict[str, Any] = data
        for key in data:
            if key not in keys:
                import difflib  # only for a message

                # A huge key would make difflib slow; nothing that long is a typo of ours.
                close = difflib.get_close_matches(key, keys, n=1) if len(key) <= 100 else []
                hint = (
                    f"did you mean {close[0]!r}?"
                    if close
                    else "see docs/reference/configuration.md"
                )
                raise ConfigError(f"{self.loc(key_text(key))}: unknown key", hint=hint)

    def loc(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def fail(self, key: str, message: str, hint: str = "") -> ConfigError:
        return ConfigError(f"{self.loc(key)}: {message}", hint=hint)

    def str_(self, key: str) -> str | None:
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, str) or not v.strip():
            raise self.fail(key, f"expected a non-empty string, got {show(v)}")
        if "\x00" in v:
            raise self.fail(key, "must not contain a NUL character")
        return v.strip()

    def pattern(self, key: str, rx: re.Pattern[str], what: str) -> str | None:
        v = self.str_(key)
        if v is not None and not rx.fullmatch(v):
            raise self.fail(key, f"expected {what}, got {v!r}")
        return v

    def url(self, key: str, schemes: tuple[str, ...]) -> str | None:
        v = self.str_(key)
        if v is None:
            return None
        return check_url(self.loc(key), v, schemes)

    def int_(self, key: str, default: int, lo: int, hi: int) -> int:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(key, f"expected an integer, got {show(v)}")
        if not lo <= v <= hi:
            raise self.fail(key, f"expected an integer from {lo} to {hi}, got {v}")
        return v

    def bool_(self, key: str, default: bool) -> bool:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, f"expected true or false, got {show(v)}")
        return v

    def size(self, key: str) -> int | None:
        v = self.get(key)
        if v is None:
            return None
        try:
            return parse_size_mib(v)
        except ValueError as e:
            raise self.fail(key, str(e)) from None

    def duration(self, key: str, default: float) -> float:
        v = self.get(key)
        if v is None:
            return default
        try:
            return parse_duration_s(v)
        except ValueError as e:
            raise self.fail(key, str(e)) from None

    def timeout_or_never(self, key: str, default: float | None) -> float | None:
        v = self.get(key)
        if isinstance(v, str) and v.strip().lower() == "never":
            return None
        if v is None:
            return default
        try:
            return parse_duration_s(v)
        except ValueError as e:
            # "never" belongs with the durations it stands beside, before what was given.
            words = str(e)
            said = words.replace(", got ", ' or "never", got ', 1)
            raise self.fail(key, said if said != words else f'{words}, or "never"') from None

    def path(self, key: str, base: Path | None) -> Path | None:
        v = self.str_(key)
        if v is None:
            return None
        p = Path(v).expanduser()
        if not p.is_absolute() and base is not None:
            p = base / p
        return p

    def str_list(self, key: str) -> tuple[str, ...]:
        v = self.get(key)
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(
            isinstance(x, str) and x.strip() and "\x00" not in x for x in v
        ):
            raise self.fail(key, f"expected a list of non-empty strings, got {show(v)}")
        return tuple(v)

    def str_map(self, key: str) -> dict[str, str]:
        v = self.get(key)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise self.fail(key, f"expected a table, got {show(v)}")
        out: dict[str, str] = {}
        for k, x in v.items():
            if isinstance(x, bool) or not isinstance(x, str | int | float):
                raise ConfigError(
                    f"{self.loc(key)}.{key_text(k)}: expected a string, got {show(x)}"
                )
            text = str(x)
            if "\x00" in text or "\x00" in k:
                raise ConfigError(
                    f"{self.loc(key)}.{key_text(k)}: must not contain a NUL character"
                )
            out[k] = text
        return out

    def choice(self, key: str, choices: tuple[str, ...], default: str | None) -> str | None:
        v = self.str_(key)
        if v is None:
            return default
        if v not in choices:
            raise self.fail(key, f"expected one of {', '.join(choices)}, got {v!r}")
        return v


def check_url(where: str, value: str, schemes: tuple[str, ...]) -> str:
    """``value`` as a URL with one of ``schemes`` and a host (a path for ``unix://``),
    without its trailing ``/``.

    Raises:
        ConfigError: it does not parse, or lacks the scheme, host or a valid port.
    """
    want = " or ".join(s + "://" for s in schemes)
    if any(c.isspace() or ord(c) < 0x20 for c in value):
        raise ConfigError(f"{where}: a URL has no spaces or control characters, got {value!r}")
    try:
        u = urlsplit(value)
        port = u.port  # raises ValueError for a port that is not a number in 0-65535
        host = u.hostname
    except ValueError as e:
        raise ConfigError(f"{where}: not a valid URL ({e}): {value!r}") from None
    if u.scheme not in schemes:
        raise ConfigError(f"{where}: expected a URL starting with {want}, got {value!r}")
    if u.scheme in _PATH_SCHEMES:
        if not (u.path or u.netloc):
            raise ConfigError(f"{where}: expected a socket path, e.g. unix:///var/run/docker.sock")
    elif not host:
        raise ConfigError(
            f"{where}: the URL names no host: {value!r}", hint=f"e.g. {schemes[0]}://127.0.0.1:9400"
        )
    if port == 0:
        raise ConfigError(f"{where}: port 0 is not a port to connect to: {value!r}")
    return value.rstrip("/")


def tname(v: Any) -> str:
    names: dict[type, str] = {dict: "a table", list: "a list", str: "a string"}
    return names.get(type(v), type(v).__name__)


def key_text(k: str) -> str:
    """A table key for a location: as written when it is plain, else quoted and cut short."""
    return k if k and k.isprintable() and len(k) <= 80 else show(k)


def show(v: Any) -> str:
    """A value for an error message, cut short: a config can hold a huge string."""
    try:
        text = repr(v)
    except RecursionError:
        return "a deeply nested value"
    return text if len(text) <= 80 else text[:77] + "..."
