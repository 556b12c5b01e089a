"""The caller's pipeline: the processes joined to this one by pipes, transitively.

``gpuctl ensure X | cat | tee X.log``: the ``tee`` two pipes away has X on its command
line but is not a server. Keyword scans leave these processes out (``own_pipeline()`` on
the caller's host; ``on_pipes`` where only the pipe inodes travel, to the agent).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from gpuctl.adapters.procinfo import own_lineage


def own_pipes() -> tuple[str, ...]:
    """The pipes on this process's stdin, stdout and stderr (``12345`` of ``pipe:[12345]``)."""
    reads, writes = _pipe_ends("self")
    return tuple(dict.fromkeys([*reads, *writes]))


def on_pipes(pid: int, pipes: Iterable[str]) -> bool:
    """True when ``pid`` reads or writes one of ``pipes`` on its stdin or stdout.

    Coarse: a background job that writes into the same pipe as the caller (``script |
    tee log``, where the script runs ``vllm serve … &``) is on it too, and is a server.
    Callers on the same host send ``own_pipeline()``'s pids instead.
    """
    wanted = {f"pipe:[{p}]" for p in pipes}
    if not wanted:
        return False
    for fd in (0, 1):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:
            continue
    return False


_NEAR_ANCESTORS = 3
_MAX_CANDIDATES = 2000


def _pipeline_candidates(me: int) -> list[int]:
    """Processes that may share a pipe with us: the descendants of our nearest ancestors
    (a pipe is made by an ancestor, a shell, and handed to its children), else all.

    Reading three descriptors of every process costs tens of milliseconds on a busy
    host; a shell's few children cost almost nothing.
    """
    ancestors = [p for p in own_lineage()[1 : 1 + _NEAR_ANCESTORS] if p > 1]
    seen: set[int] = set()
    todo = list(ancestors)
    while todo:
        kids = _children(todo.pop())
        if kids is None or len(seen) > _MAX_CANDIDATES:
            return [int(d) for d in _listdir("/proc") if d.isdigit() and int(d) != me]
        for k in kids:
            if k not in seen and k != me:
                seen.add(k)
                todo.append(k)
    return sorted(seen)


def _children(pid: int) -> list[int] | None:
    """``pid``'s children (``/proc/<pid>/task/<pid>/children``); None where the kernel
    does not offer that file. Threads other than the main one may fork too: all tasks."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # gone
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(w) for w in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended
            return None
        except OSError:
            continue
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _pipe_ends(pid: int | str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The pipes ``pid`` reads on stdin, and writes on stdout and stderr."""
    ends: list[list[str]] = [[], []]
    for fd in (0, 1, 2):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:["):
            ends[0 if fd == 0 else 1].append(target[6:-1])
    return tuple(ends[0]), tuple(ends[1])


_PIPELINE_TTL_S = 5.0
_pipeline_cache: tuple[float, tuple[int, ...]] | None = None


def own_pipeline() -> tuple[int, ...]:
    """The processes joined to this one by pipes, transitively: what reads what we write
    (``gpuctl ensure X | cat | tee X.log``: cat, then tee) and what writes what we read.

    Followed along the data only, so a background job that merely shares a pipe with us
    (it writes where we write: ``script | tee``, the script running ``vllm serve … &``)
    is not in it: it is a server. Only our own processes' descriptors can be read (or
    all, as root), which is where a pipeline is. Cached for a few seconds.
    """
    global _pipeline_cache  # noqa: PLW0603  (one pipeline per process; refreshed now and then)
    now = time.monotonic()
    if _pipeline_cache is not None and now - _pipeline_cache[0] < _PIPELINE_TTL_S:
        return _pipeline_cache[1]
    found = _pipeline_of(os.getpid())
    _pipeline_cache = (now, found)
    return found


def _pipeline_of(me: int) -> tuple[int, ...]:
    my_reads, my_writes = _pipe_ends(me)
    if not my_reads and not my_writes:
        return ()
    readers: dict[str, list[int]] = {}
    writers: dict[str, list[int]] = {}
    ends: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for pid in _pipeline_candidates(me):
        reads, writes = ends[pid] = _pipe_ends(pid)
        for p in reads:
            readers.setdefault(p, []).append(pid)
        for p in writes:
            writers.setdefault(p, []).append(pid)
    out: set[int] = set()

    def follow(start: tuple[str, ...], step: dict[str, list[int]], downstream: bool) -> None:
        todo, seen = list(start), set(start)
        while todo:
            for pid in step.get(todo.pop(), ()):
                if pid in out:
                    continue
                out.add(pid)
                for p in ends[pid][1 if downstream else 0]:
                    if p not in seen:
                        seen.add(p)
                        todo.append(p)

    follow(my_writes, readers, downstream=True)
    follow(my_reads, writers, downstream=False)
    return tuple(sorted(out))
