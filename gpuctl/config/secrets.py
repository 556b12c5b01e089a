"""Secrets named by the config: read when a request needs one, never stored in the file.

A host names an environment variable (``token_env``) or a file (``token_file``) for each
secret: the agent's write token, its read-only token, the Jupyter server's token.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuctl.errors import ConfigError


def read_secret(host: str, what: str, env: str | None, file: Path | None) -> str | None:
    """The secret ``hosts.<host>.<what>_env`` / ``<what>_file`` names; None when neither is set.

    Raises:
        ConfigError: the variable is unset or empty, or the file is missing, a folder,
            unreadable or empty.
    """
    if env:
        value = os.environ.get(env, "").strip()
        if not value:
            raise ConfigError(
                f"hosts.{host}.{what}_env: environment variable {env} is not set",
                hint=f"export {env}=<token>, or use {what}_file",
            )
        return value
    if file:
        from gpuctl.config.readfile import TOKEN_LIMIT, NotSmallFile, read_small

        try:
            value = read_small(file, TOKEN_LIMIT).decode("utf-8").strip()
        except NotSmallFile as e:
            raise ConfigError(
                f"hosts.{host}.{what}_file: {e}",
                hint="point it at the file that holds the token",
            ) from None
        except IsADirectoryError:
            raise ConfigError(
                f"hosts.{host}.{what}_file: {file} is a folder, not a file",
                hint="point it at the file that holds the token",
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ConfigError(
                f"hosts.{host}.{what}_file: cannot read {file}: {reason}",
                hint="create the file (mode 600) or fix the path",
            ) from None
        if not value:
            raise ConfigError(
                f"hosts.{host}.{what}_file: {file} is empty",
                hint="write the token into it",
            )
        return value
    return None


def token_file_warning(path: Path) -> str | None:
    """A warning when a secret file is readable by group or others, else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) and mode & (stat.S_IRGRP | stat.S_IROTH):
        return f"{path} is readable by others (mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}"
    return None


def write_secret_file(path: Path, secret: str) -> None:
    """Create ``path`` holding ``secret`` with mode 600 from the start (never a moment
    readable by others, whatever the umask); refuse to replace an existing file.

    Raises:
        FileExistsError: the file exists.
        OSError: it cannot be created.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only remove bits, but be explicit
        os.write(fd, (secret + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_key_list(env: str | None, file: Path | None) -> tuple[str, ...]:
    """The proxy's client keys from ``proxy.api_keys_env`` (separated by commas or
    whitespace) or ``proxy.api_keys_file`` (one a line, ``#`` comments); () when neither
    is set.

    Raises:
        ConfigError: the variable is unset or empty, or the file is missing, unreadable
            or holds no key.
    """
    if env:
        raw = os.environ.get(env)
        keys = tuple(k for k in (raw or "").replace(",", " ").split() if k)
        if not keys:
            what = "is not set" if raw is None else "is set but holds no key"
            raise ConfigError(
                f"proxy.api_keys_env: environment variable {env} {what}",
                hint=f"export {env}=<key>[,<key>...], or use api_keys_file",
            )
        return keys
    if file:
        from gpuctl.config.readfile import CONFIG_LIMIT, NotSmallFile, read_small

        try:
            text = read_small(file, CONFIG_LIMIT).decode("utf-8")
        except NotSmallFile as e:
            raise ConfigError(
                f"proxy.api_keys_file: {e}", hint="point it at the file of keys (one a line)"
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ConfigError(
                f"proxy.api_keys_file: cannot read {file}: {reason}",
                hint="create the file (mode 600, one key a line) or fix the path",
            ) from None
        keys = _keys_of(text, file)
        if not keys:
            raise ConfigError(
                f"proxy.api_keys_file: {file} holds no key", hint="write one key a line into it"
            )
        return keys
    return ()


def _keys_of(text: str, file: Path) -> tuple[str, ...]:
    """One key a line; a line whose first character past its indent is ``#`` is a
    comment (an indented, commented-out key was a live key), and so is what follows a
    key after a space and ``#`` (it was taken into the key, which then matched nothing).

    Raises:
        ConfigError: a line holds more than one word before any comment.
    """
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) > 1 and not words[1].startswith("#"):
            raise ConfigError(
                f"proxy.api_keys_file: {file}, line {n}: a key holds no spaces",
                hint="write one key a line, with any comment after a space and '#'",
            )
        keys.append(words[0])
    return tuple(keys)
