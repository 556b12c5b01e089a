"""What the store voided: leases and entries gpuctl never wrote, for ``gpuctl locks``.

A lease or an entry whose term is longer than its kind's documented one, or whose holder
on this host is at pid 1 or has no start time (``core.record.void_why``), counts for
nothing. It is never simply dropped, so a person can see who planted it:

- a queue or in-flight entry is renamed beside itself once by the reader that finds it
  (``<id>.json.void-<time>``, ``files.set_aside_void``) and logged once;
- a record's lease (a service's, ``_reclaim``'s, ``_admission``'s) stays in its record
  until a holder's lease replaces it; that writer first keeps a copy of the record
  (``<service>.json.void-<time>``) and logs it.

Both stay until someone removes them. Listing them is ``gpuctl locks``'s cost only:
``status`` never calls ``voided``. The copies are counted and summarised like the
set-aside files (``direct.set_aside``), never all read: the newest ``MAX_VOIDED_LISTED``
are read (each a small bounded read), and one row counts the rest.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from gpuctl.adapters.store.base import _NAME
from gpuctl.adapters.store.codec import (
    QUEUE_TTL_MAX_S,
    RecordError,
    decode_lease,
    decode_waiter,
    parse_json,
    parse_record,
)
from gpuctl.adapters.store.files import LINK_SUFFIX, Folder
from gpuctl.core.record import (
    INFLIGHT_TTL_MAX_S,
    TERM_MAX_S,
    Lease,
    Record,
    Voided,
    void_why,
)
from gpuctl.core.snapshot import HostIdentity

# A lease or entry found forged (``core.record.void_why``): ``<name>.void-<time>``.
VOID_SUFFIX: Final = ".void-"


def set_aside_void(folder: Folder, name: str, now: float, why: str) -> None:
    """A queue or in-flight entry found forged: renamed beside itself once, kept for a
    person (``gpuctl locks`` shows who held it and why it is void) and logged once. It
    counts for nothing either way; a reader that may not rename it deletes it."""
    try:
        kept = folder.set_aside(name, VOID_SUFFIX, now)
    except OSError:
        with contextlib.suppress(OSError):
            folder.unlink(name)
        return
    log.warning("%s is void (%s); set aside as %s", folder.path / name, why, kept)


log = logging.getLogger("gpuctl.store")
MAX_VOIDED_LISTED = 100
_ENTRY_BYTES = 4096
# ``<name>.json.void-<time>`` (``-1``, ``-2`` … when two land in one second).
_VOID = re.compile(r"(?P<name>.+)\.json\.void-(?P<stamp>\d{1,12})(?:-\d+)?")
# The leases ``locks`` lists beside the services' own (never services themselves).
PSEUDO_LEASES = ("_admission", "_reclaim")


def voided(
    state_dir: Path,
    records: Iterable[Record],
    here: HostIdentity,
    now: float,
) -> list[Voided]:
    """Every void lease still in its record (``records``: the services' records and the
    pseudo-leases'), then the voided copies kept in the state folder, oldest first."""
    out: list[Voided] = []
    for rec in records:
        lease = rec.lease
        if lease is None:
            continue
        why = _why(lease, now, here, TERM_MAX_S.get(rec.service))
        if why is not None:
            file = f"records/{rec.service}.json"
            out.append(
                Voided("lease", rec.service, file, lease.host, lease.pid, lease.granted, why)
            )
    found = _copies(state_dir)
    found.sort(key=lambda t: (-t[3], t[2]))
    out += [_describe(state_dir, item, here) for item in found[:MAX_VOIDED_LISTED]]
    left = found[MAX_VOIDED_LISTED:]
    if left:
        why = f"{len(left)} more voided copies, not read; remove them once seen"
        out.append(Voided("more", "*", f"+{len(left)} more", "", 0, max(t[3] for t in left), why))
    return sorted(out, key=lambda v: (v.at, v.file))


def _why(lease: Lease, now: float, here: HostIdentity, longest: float | None) -> str | None:
    return void_why(lease, now, here_host=here.hostname, here_boot_id=here.boot_id, longest=longest)


def _copies(state_dir: Path) -> list[tuple[str, str, str, float]]:
    """(kind, service, path under the state folder, when) of each voided copy: listed
    by name only (never read, never followed)."""
    out: list[tuple[str, str, str, float]] = []

    def scan(parts: tuple[str, ...], kind: str, service: str | None) -> list[str]:
        try:
            with Folder(state_dir, *parts) as folder:
                names = folder.names()
        except OSError:  # none yet, a file, or a link (set aside by the store)
            return []
        prefix = "".join(f"{p}/" for p in parts)
        for name in names:
            m = _VOID.fullmatch(name)
            if m is not None:
                out.append((kind, service or m["name"], prefix + name, float(m["stamp"])))
        return names

    scan(("records",), "lease", None)
    scan(("queue",), "queue", "_queue")
    for name in scan(("inflight",), "inflight", ""):
        if _NAME.fullmatch(name) and LINK_SUFFIX not in name:  # a service's folder
            scan(("inflight", name), "inflight", name)
    return out


def _describe(state_dir: Path, found: tuple[str, str, str, float], here: HostIdentity) -> Voided:
    """One voided copy, read again: its holder, and why it is void as of when it was set
    aside (its ``at``; a term that was in the future then still is)."""
    kind, service, rel, at = found
    folder_rel, _, name = rel.rpartition("/")
    longest: Callable[[], float | None] = {
        "lease": lambda: TERM_MAX_S.get(service),
        "inflight": lambda: INFLIGHT_TTL_MAX_S,
        "queue": lambda: QUEUE_TTL_MAX_S,
    }[kind]
    try:
        with Folder(state_dir, *folder_rel.split("/")) as folder:
            if kind == "lease":
                lease = parse_record(folder.read(name)).lease
            else:
                data = parse_json(folder.read(name, _ENTRY_BYTES), _ENTRY_BYTES)
                lease = decode_lease(data) if kind == "inflight" else decode_waiter(data).holder
    except (OSError, RecordError) as e:
        why = getattr(e, "strerror", None) or str(e)
        return Voided(kind, service, rel, "", 0, at, f"cannot read it: {why}"[:4096])
    if lease is None:
        return Voided(kind, service, rel, "", 0, at, "it holds no lease")
    why = _why(lease, at, here, longest()) or "it reads as sound now"
    return Voided(kind, service, rel, lease.host, lease.pid, at, why)
