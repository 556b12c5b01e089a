"""Parsing the query parameters of ``GET /status``: bounded, and a 400 on anything else."""

from __future__ import annotations

import re

from gpuctl.agent.http import HttpError

# A client can send any keyword set; these bound what it can make us remember.
MAX_MATCH_KEYWORDS = 32
MAX_KEYWORD_LEN = 200
MAX_MATCH_SETS = 128
# A caller's process tree and pipeline: a few dozen at most.
MAX_EXCLUDE = 256


def _pid_list(most: int) -> str:
    """A pattern for up to ``most`` comma-separated pids, 1 to ``PID_MAX``, by digits."""
    pid = (
        r"([1-9][0-9]{0,5}|[1-3][0-9]{6}|40[0-9]{5}|41[0-8][0-9]{4}"
        r"|419[0-3][0-9]{3}|4194[0-2][0-9]{2}|419430[0-4])"
    )
    return f"^({pid}(,{pid}){{0,{most - 1}}})?$"


# The exact forms the OpenAPI document declares (openapi.py uses these): the agent
# accepts what they match and nothing else, so a schema-valid request is never refused
# and an invalid one never slips through.
MATCH_PATTERN = (
    rf"^[^,]{{0,{MAX_KEYWORD_LEN}}}(,[^,]{{0,{MAX_KEYWORD_LEN}}}){{0,{MAX_MATCH_KEYWORDS - 1}}}$"
)
PIDS_PATTERN = _pid_list(MAX_MATCH_KEYWORDS)
EXCLUDE_PATTERN = _pid_list(MAX_EXCLUDE)
PIPES_PATTERN = rf"^([0-9]{{1,19}}(,[0-9]{{1,19}}){{0,{MAX_EXCLUDE - 1}}})?$"
FRESH_VALUES = ("0", "1", "true", "false")
_MATCH = re.compile(MATCH_PATTERN)
_PIDS = re.compile(PIDS_PATTERN)
_EXCLUDE = re.compile(EXCLUDE_PATTERN)
_PIPES = re.compile(PIPES_PATTERN)


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    if values is None:
        return None
    if len(values) > 1:
        raise HttpError(400, f"{name} given {len(values)} times; give it once")
    return values[0]


def parse_match(query: dict[str, list[str]]) -> tuple[str, ...] | None:
    """The normalised keyword set of ``?match=kw1,kw2`` (None when absent).

    Matching is case-insensitive, so ``vLLM,vllm`` and ``vllm`` share one cache entry.
    """
    value = _one(query, "match")
    if value is None:
        return None
    if not _MATCH.fullmatch(value):
        raise HttpError(
            400,
            f"match: at most {MAX_MATCH_KEYWORDS} comma-separated keywords of at most "
            f"{MAX_KEYWORD_LEN} characters",
        )
    words = {w.strip().lower() for w in value.split(",")}
    words.discard("")
    return tuple(sorted(words))


def _numbers(query: dict[str, list[str]], name: str, pattern: re.Pattern[str]) -> list[int]:
    value = _one(query, name)
    if not value:
        return []
    if not pattern.fullmatch(value):
        raise HttpError(
            400, f"{name} must be comma-separated numbers (see /openapi.json), got {value[:40]!r}"
        )
    return [int(w) for w in value.split(",")]


def parse_exclude(
    query: dict[str, list[str]], boot_id: str
) -> tuple[frozenset[int], tuple[str, ...]]:
    """``?exclude=pid,pid&pipes=inode,inode&boot_id=B``: the caller's own process tree,
    and the pipes on its stdio, to leave out of ``starting``.

    Checked always (a bad value is a 400 wherever it comes from), but only honoured when
    ``boot_id`` is this host's: pids mean nothing on another machine.
    """
    pids = frozenset(_numbers(query, "exclude", _EXCLUDE))
    pipes = tuple(str(n) for n in _numbers(query, "pipes", _PIPES))
    if not boot_id or _one(query, "boot_id") != boot_id:
        return frozenset(), ()
    return pids, pipes


def parse_pids(query: dict[str, list[str]]) -> list[int]:
    """``?pids=1,2``: recorded servers to report under ``starting`` whatever their command."""
    return _numbers(query, "pids", _PIDS)


def parse_fresh(query: dict[str, list[str]]) -> bool:
    """``?fresh=1``: read the GPU and the processes now, not from the reading cache."""
    value = _one(query, "fresh")
    if value is None:
        return False
    if value not in FRESH_VALUES:
        raise HttpError(400, f"fresh must be one of {', '.join(FRESH_VALUES)}, got {value[:20]!r}")
    return value in ("1", "true")


KNOWN = frozenset({"match", "fresh", "pids", "exclude", "pipes", "boot_id"})


def check_known(query: dict[str, list[str]]) -> None:
    """Refuse a parameter /status does not know: a typo (``?fersh=1``) must not pass
    for a request that was honoured."""
    unknown = sorted(set(query) - KNOWN)
    if unknown:
        raise HttpError(
            400,
            f"unknown query parameter {unknown[0][:40]!r}",
            f"/status takes {', '.join(sorted(KNOWN))}",
        )
