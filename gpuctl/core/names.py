"""The one rule for service and host names, shared by the config, the store and the agent.

A name becomes a file name in the state directory, a Docker container name
(``gpuctl-<name>``), a Jupyter terminal name and a URL path segment, so it is ASCII,
starts with a letter, digit or ``_`` (never ``.`` or ``-``: no hidden files, no
options), and is at most 101 characters. ``NAME_PATTERN`` is anchored for JSON
Schema (the agent's OpenAPI document); Python must match it with ``fullmatch``:
``re.match`` with ``$`` accepts a trailing newline.
"""

from __future__ import annotations

import re

NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}$"
NAME_RE = re.compile(NAME_PATTERN, re.ASCII)


def is_valid_name(name: object) -> bool:
    """Whether ``name`` is a service or host name the store and the agent accept."""
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


NAME_RULE = "letters, digits, '_', '.' and '-' (not first), at most 101 characters"


RESERVED_PREFIX = "_"


def is_service_name(name: object) -> bool:
    """Whether ``name`` may name a configured service: a valid name that does not start
    with ``_``, the prefix of the store's own entries (``_admission``, ``_inflight``,
    ``_reclaim``): a service called that would share their lock and record."""
    return is_valid_name(name) and not str(name).startswith(RESERVED_PREFIX)
