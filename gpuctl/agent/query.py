"""Parsing the query parameters of ``GET /status``: bounded, and a 400 on anything else."""

from __future__ import annotations

from gpuctl.agent.http import HttpError

# A client can send any keyword set; these bound what it can make us remember.
MAX_MATCH_KEYWORDS = 32
MAX_KEYWORD_LEN = 200
MAX_MATCH_SETS = 128


def parse_match(query: dict[str, list[str]]) -> tuple[str, ...] | None:
    """The normalised keyword set of ``?match=kw1,kw2`` (None when absent).

    Matching is case-insensitive, so ``vLLM,vllm`` and ``vllm`` share one cache entry.
    """
    values = query.get("match")
    if values is None:
        return None
    words = {w.strip().lower() for v in values for w in v.split(",")}
    words.discard("")
    if len(words) > MAX_MATCH_KEYWORDS:
        raise HttpError(400, f"at most {MAX_MATCH_KEYWORDS} match keywords per request")
    if any(len(w) > MAX_KEYWORD_LEN for w in words):
        raise HttpError(400, f"a match keyword is longer than {MAX_KEYWORD_LEN} characters")
    return tuple(sorted(words))


def parse_exclude(
    query: dict[str, list[str]], boot_id: str
) -> tuple[frozenset[int], tuple[str, ...]]:
    """``?exclude=pid,pid&pipes=inode,inode&boot_id=B``: the caller's own process tree,
    and the pipes on its stdio, to leave out of ``starting``.

    Only honoured when ``boot_id`` is this host's: pids mean nothing on another machine.
    """
    if not boot_id or query.get("boot_id", [""])[0] != boot_id:
        return frozenset(), ()
    try:
        pids = frozenset(
            int(w) for v in query.get("exclude", []) for w in v.split(",") if w.strip()
        )
        pipes = tuple(str(int(w)) for v in query.get("pipes", []) for w in v.split(",") if w)
    except ValueError:
        raise HttpError(400, "exclude must be pids, and pipes pipe inodes") from None
    return pids, pipes


def parse_pids(query: dict[str, list[str]]) -> list[int]:
    """``?pids=1,2``: recorded servers to report under ``starting`` whatever their command."""
    try:
        pids = [int(w) for v in query.get("pids", []) for w in v.split(",") if w.strip()]
    except ValueError:
        raise HttpError(400, "pids must be a comma-separated list of pids") from None
    if len(pids) > MAX_MATCH_KEYWORDS:
        raise HttpError(400, f"at most {MAX_MATCH_KEYWORDS} pids per request")
    return [p for p in pids if p > 0]


def parse_fresh(query: dict[str, list[str]]) -> bool:
    """``?fresh=1``: read the GPU and the processes now, not from the reading cache."""
    values = query.get("fresh")
    if not values:
        return False
    value = values[-1].strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no", ""):
        return False
    raise HttpError(400, f"fresh must be 1 or 0, got {value[:20]!r}")
