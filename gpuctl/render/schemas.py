"""The ``--json`` outputs declared once, as msgspec Structs, and ``schemas/*.json``
generated from them.

Each output (``status``, ``locks``, ``reclaim``, ``ensure``, ``stop``; schema 1) is one
top-level Struct here (``events`` and ``usage`` are declared beside their renderer,
``render.events_view``); the renderers (``status_json``, ``locks``, ``reclaim_view``,
``results``) build the objects these describe, and tests/test_schemas.py checks real
output against the generated files. Every key a renderer writes is required (scripts may
rely on it; null says unknown); a Struct the output leaves open for keys of its own
(a launcher's ``handle``) says so in ``OPEN``.

Regenerate after changing a Struct (a test diffs the committed files against this)::

    python -m gpuctl.render.schemas          # writes schemas/*.schema.json
    python -m gpuctl.render.schemas --check  # exits 1 naming a stale file
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from gpuctl.render.events_view import EventsOut, UsageOut

# --- shared pieces ----------------------------------------------------------------------

TIMESTAMP_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z$"
Timestamp = Annotated[
    str,
    Meta(
        pattern=TIMESTAMP_PATTERN,
        description="ISO-8601 UTC with milliseconds, the one timestamp form of gpuctl's output.",
    ),
]
NonNeg = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(ge=0)]
Pct = Annotated[float, Meta(ge=0, le=100)]
UnixTime = Annotated[float, Meta(description="Unix time, seconds.")]
Outcome = Literal[
    "ready", "started", "loading", "busy", "unknown", "failed", "timeout", "interrupted"
]


def _doc(text: str) -> Meta:
    return Meta(description=text)


# The ``pool`` key of every output that has a row per service and host (status, locks,
# reclaim, events; usage: per service): one declaration, one meaning.
PoolHosts = Annotated[
    list[str] | None,
    _doc(
        "A pooled service (`hosts = [...]`): every host of its pool, in the config's "
        "order; it has one row per host, each with its own `host`, and its rows go "
        "together. Null for a service on one host."
    ),
]


# --- status --json -----------------------------------------------------------------------


class StatusMig(Struct):
    id: Annotated[NonNeg, _doc("The GPU instance id.")]
    uuid: str | None
    memory_used_mib: NonNeg | None
    memory_total_mib: NonNeg | None


class StatusDevice(Struct):
    """One GPU as the probe saw it. A GPU that could not be read has its error, and null
    figures."""

    index: Annotated[NonNeg, _doc("The GPU's index.")]
    name: Annotated[str | None, _doc("Its model, e.g. NVIDIA GB10.")]
    uuid: str | None
    memory_used_mib: NonNeg | None
    memory_total_mib: NonNeg | None
    memory_promised_mib: Annotated[
        NonNeg | None,
        _doc("Promised to loading or starting services on this GPU, beyond what they hold."),
    ]
    unified: Annotated[
        bool,
        _doc(
            "The GPU has no memory figure of its own (GB10): its total comes from the config "
            "or MemTotal, its used memory from its processes."
        ),
    ]
    utilization_pct: Annotated[
        Pct | None, _doc("GPU utilisation; null when unknown (never 0 for unknown).")
    ]
    temperature_c: float | None
    power_w: Seconds | None
    error: Annotated[str | None, _doc("Why this GPU could not be read.")]
    mig: Annotated[
        list[StatusMig],
        _doc(
            "With MIG on, the GPU's instances: a service fits on one instance, and a service's "
            "devices = [0] means any instance of GPU 0. Empty with MIG off."
        ),
    ]


class StatusProcess(Struct):
    """A process on the GPU."""

    pid: Positive
    command: Annotated[
        str | None,
        _doc(
            "The full command line (secret-looking values redacted); null when it cannot be "
            "read (another PID namespace, no permission)."
        ),
    ]
    memory_mib: Annotated[
        NonNeg | None, _doc("GPU memory it holds; null when the driver does not say.")
    ]
    user: str | None
    container: Annotated[str | None, _doc("Container id, from /proc/PID/cgroup.")]
    gpu: Annotated[NonNeg | None, _doc("The GPU's index.")]
    on_gpu: bool
    sm_util_pct: Annotated[
        Pct | None, _doc("Per-process SM utilisation; null when unknown (never 0 for unknown).")
    ]
    service: Annotated[str | None, _doc("The configured service it belongs to, if any.")]
    mig: Annotated[
        NonNeg | None,
        _doc(
            "The MIG instance (GPU instance id) it runs in; null with MIG off or where the "
            "driver does not say."
        ),
    ]


class StatusStarting(Struct):
    """A host process whose command line holds a service's match keyword, not on the GPU
    yet."""

    pid: Positive
    command: str
    user: str | None
    age_s: Annotated[Seconds | None, _doc("Seconds since it started, on the host's clock.")]
    service: str | None


class StatusIdentity(Struct):
    hostname: str
    boot_id: str


class StatusOther(Struct):
    """A service the host's records name and this config does not, while it holds or
    promises memory. Admission counts it at its record's promise; with promise_known false
    (an older gpuctl wrote the record) its memory is unknown, and nothing beside it is
    called free."""

    name: str
    in_config: Annotated[bool, Meta(extra_json_schema={"const": False})]
    phase: Annotated[
        Literal["starting", "running", "sleeping", "stopping", "preempted", "stopped", "failed"],
        _doc("The record's phase."),
    ]
    budget_mib: Annotated[
        NonNeg | None, _doc("The memory its start promised; null: none stated, or unknown.")
    ]
    priority: int | None
    kind: Literal["server", "batch"] | None
    devices: Annotated[list[NonNeg] | None, _doc("The GPUs it may land on; null: any one.")]
    promise_known: Annotated[bool, _doc("The record says what its start promised.")]
    pids: Annotated[list[Positive], _doc("Its server's processes, as the records name them.")]
    memory_mib: Annotated[NonNeg, _doc("What those processes hold now.")]
    reason: str


class StatusHost(Struct):
    """One host. One that did not answer has ok false, its error and hint, null figures and
    empty lists."""

    name: Annotated[str, _doc("The host's name in the config.")]
    source: Annotated[str | None, _doc("The agent's URL, or how the GPU was read locally.")]
    ok: Annotated[bool, _doc("The host answered.")]
    error: Annotated[str | None, _doc("Why it did not answer.")]
    hint: Annotated[str | None, _doc("What to do about it.")]
    probe: Annotated[str | None, _doc("The probe that read the GPU: nvml, nvidia-smi or sim.")]
    memory_used_mib: NonNeg | None
    memory_total_mib: NonNeg | None
    memory_promised_mib: Annotated[
        NonNeg | None, _doc("Memory promised to services that are loading, beyond what they hold.")
    ]
    unified_memory: bool | None
    is_idle: Annotated[
        bool | None,
        _doc(
            "True only when no process is on a GPU, every GPU could be read and none holds "
            "more than the driver's reserve (1024 MiB) that no process accounts for; from an "
            "agent, also no record of its store holds a lease or says starting."
        ),
    ]
    taken_at: Annotated[Timestamp | None, _doc("When the host read its GPU.")]
    host: Annotated[StatusIdentity | None, _doc("The agent's host identity.")]
    state_dir: Annotated[str | None, _doc("The host's state directory.")]
    notes: Annotated[
        list[str],
        _doc(
            "What the probe wants a person to know about this reading (a simulated GPU whose "
            "gpu.json overrides the total asked for; NVML read through nvidia-smi); never part "
            "of a decision. Empty for a host that did not answer."
        ),
    ]
    processes: list[StatusProcess]
    starting: list[StatusStarting]
    devices: Annotated[
        list[StatusDevice],
        _doc("Each GPU (admission reads these); the host's memory figures are their sums."),
    ]
    others: Annotated[list[StatusOther], _doc("Services only other configs name (see other).")]


class StatusVictim(Struct):
    name: Annotated[str, _doc("The service, or the run job's record name (run.NAME).")]
    gpu: NonNeg
    frees_mib: Annotated[NonNeg, _doc("What stopping it gives back on that GPU.")]
    priority: int
    job: Annotated[bool, _doc("A `gpuctl run --preemptible` job rather than a service.")]
    idle_s: Annotated[
        Seconds | None,
        _doc(
            "Seconds it has been idle, where it is an idle server (unused past its "
            "yield_after, nothing in flight); null otherwise. A victim of equal or higher "
            "priority is one only so."
        ),
    ]


class StatusHolder(Struct):
    pid: Positive
    command: Annotated[
        str | None, _doc("Its command line, secrets redacted; null where it cannot be read.")
    ]
    memory_mib: NonNeg | None
    gpu: NonNeg
    user: str | None
    service: Annotated[
        str | None,
        _doc("The service (or run.NAME job) it is, when it is ours; null for a foreign process."),
    ]
    priority: Annotated[
        int | None, _doc("That service's or job's priority; null for a foreign process.")
    ]


class StatusService(Struct):
    """One configured service and its decision."""

    name: str
    host: str
    decision: Literal[
        "READY",
        "UNKNOWN",
        "SLEEPING",
        "LOADING",
        "FAILED",
        "IDLE",
        "FITS",
        "PREEMPTABLE",
        "BUSY",
    ]
    reason: str
    health: Annotated[
        Literal["ready", "refused", "timeout", "error", "sleeping", "none"],
        _doc("Its health check's answer."),
    ]
    memory_mib: Annotated[NonNeg | None, _doc("What its processes hold.")]
    budget_mib: Annotated[NonNeg | None, _doc("Its configured memory budget.")]
    priority: int
    pids: list[Positive]
    gpu: Annotated[
        NonNeg | None,
        _doc("The GPU it fits on (IDLE, FITS; PREEMPTABLE: once its victims stop), else null."),
    ]
    yields: Annotated[
        bool,
        _doc(
            "A server idle past its yield_after (no request in flight, no lease, unused that "
            "long): any start or job that asks to preempt stops it, whatever the priorities. "
            "Never a batch or a run job."
        ),
    ]
    idle_s: Annotated[
        Seconds | None,
        _doc(
            "With yields: seconds since its last use (since it began running, if never "
            "used); else null."
        ),
    ]
    hint: Annotated[
        str | None,
        _doc(
            "What the user can do about it (PREEMPTABLE: the `gpuctl ensure SERVICE --preempt` "
            "that would make room); null when nothing. The reason repeats it as "
            '"(hint: ...)".'
        ),
    ]
    victims: Annotated[
        list[StatusVictim],
        _doc(
            "PREEMPTABLE: what `gpuctl ensure SERVICE --preempt` would stop, all on one GPU; "
            "empty otherwise."
        ),
    ]
    holders: Annotated[
        list[StatusHolder],
        _doc(
            "BUSY and PREEMPTABLE: the processes holding the GPU memory it needs (on the GPUs "
            "it may use); empty otherwise."
        ),
    ]
    pool: PoolHosts


class StatusOutput(Struct):
    schema: Literal[1]
    taken_at: Timestamp
    ok: Annotated[bool, _doc("Every host answered.")]
    hosts: list[StatusHost]
    services: list[StatusService]


# --- records, as locks and ensure print them ---------------------------------------------


class Attempt(Struct, kw_only=True):
    """One start attempt."""

    started: UnixTime
    ended: UnixTime
    duration_s: Seconds
    launcher: Annotated[str, _doc("The launcher that ran it: process, docker, jupyter, ollama.")]
    outcome: Annotated[
        str, _doc("How the start ended (an ensure outcome: ready, failed, timeout, ...).")
    ]
    error: Annotated[str, _doc("Only when the start did not end ready.")] | UnsetType = UNSET


class Handle(Struct, kw_only=True):
    """What the launcher needs to find the server again; its other keys depend on `kind`
    (process: pid, pid_start, pid_ns, log; docker: the container; jupyter: the terminal)."""

    kind: Annotated[str, _doc("The launcher: process, docker, jupyter, ollama.")]
    pid_ns: (
        Annotated[
            NonNeg | None,
            _doc(
                "The PID namespace (the inode of /proc/<pid>/ns/pid) the pid is numbered in: "
                "only a reader in the same one takes 'no such pid' for 'gone'."
            ),
        ]
        | UnsetType
    ) = UNSET


class Lease(Struct):
    holder: Annotated[str, _doc("The holder's id (fresh per call).")]
    host: str
    boot_id: str
    pid: Positive
    pid_start: Annotated[
        float,
        _doc("The holder's start time (Unix time), so a reused pid is never mistaken for it."),
    ]
    entry: Annotated[str, _doc("The entry point that holds it: ensure, stop, reclaim, ...")]
    granted: UnixTime
    expires: UnixTime
    expires_in_s: float


class Failure(Struct):
    """The last failed start and its back-off."""

    at: UnixTime
    error: str
    log_tail: str
    count: Positive
    backoff_until: UnixTime


class Promise(Struct):
    """What the service's last start promised the host, written with its lease: every
    client counts the service at these figures, whatever its own config says."""

    memory_mib: Annotated[Positive | None, _doc("Its memory budget; null: none.")]
    priority: int
    devices: Annotated[
        Annotated[list[NonNeg], Meta(min_length=1, extra_json_schema={"uniqueItems": True})] | None,
        _doc("The GPUs it may land on; null: any one."),
    ]
    kind: Literal["server", "batch"]
    resume: bool
    health_timeout_s: Seconds
    yield_after_s: Annotated[
        Seconds | None, _doc("Unused this long, it yields to any start that preempts; null: never.")
    ]


class Repair(Struct):
    """A repair note (kept among the attempts, no start): a phase that lied about its
    server, healed by whoever read it."""

    outcome: Literal["repaired"]
    ended: Annotated[float, _doc("Unix time, seconds: when the phase was repaired.")]
    repaired: Annotated[
        str,
        _doc(
            'What was repaired and why: "preempted -> running: its server still runs (the '
            'preemptor stopped before signalling it)".'
        ),
    ]
    by: Annotated[
        str, _doc("The entry point that repaired it: ensure, reclaim, locks, status, agent.")
    ]


def _one_of(*names: str, key: str = "anyOf") -> Meta:
    """An object that is one of these Structs (msgspec's unions take one Struct only)."""
    return Meta(extra_json_schema={key: [{"$ref": f"#/$defs/{n}"} for n in names]})


class LocksRecord(Struct):
    """One service's record."""

    host: str
    service: str
    phase: Literal["stopped", "starting", "running", "sleeping", "stopping", "preempted", "failed"]
    since: Timestamp | None
    last_used: Timestamp | None
    idle_s: Seconds | None
    lease: Lease | None
    handle: Handle | None
    failure: Failure | None
    attempts: list[Annotated[dict[str, Any], _one_of("Attempt", "Repair")]]
    starts: Annotated[
        NonNeg,
        _doc(
            "How many start attempts the record keeps (its attempts, less the repair notes): "
            "its last 10, so a lower bound once starts_capped."
        ),
    ]
    repaired: Annotated[
        Repair | None,
        _doc(
            'The latest repair of the record\'s phase (one of its attempts, outcome "repaired"). '
            "null: none kept."
        ),
    ]
    starts_capped: Annotated[
        bool,
        _doc(
            "The kept history is full (10 or more): older starts were dropped from it, so "
            "there were at least starts, maybe more (the text view's STARTS shows 10+)."
        ),
    ]
    recovered: Annotated[
        str | None,
        _doc("The record was unreadable: set aside (kept) and started afresh; says why."),
    ]
    error: None
    promise: Annotated[
        Promise | None,
        _doc("What its last start promised; null in a record an older release wrote."),
    ]
    pool: PoolHosts


class LocksUnreadable(Struct):
    """A host whose records could not be read."""

    host: str
    error: str


class SetAside(Struct):
    """A record file that failed validation and was kept beside the records (its service
    started afresh); listed until someone removes it."""

    host: str
    service: str
    file: Annotated[str, _doc("Its name in the host's records folder.")]
    at: Annotated[Timestamp, _doc("When it was set aside.")]
    size: Annotated[NonNeg, _doc("Bytes.")]
    why: Annotated[str, _doc("Where it failed the record schema.")]


class Waiter(Struct):
    """One `gpuctl run --wait` caller in a host's wait queue. The queue is served by
    priority, then arrival, strictly from its head: only position 1 may be admitted (once
    it fits)."""

    host: str
    position: Annotated[Positive, _doc("Its place in its host's queue: 1 is served next.")]
    name: Annotated[str, _doc("The job's record name (run.<name>).")]
    priority: Annotated[int, _doc("Higher is served first.")]
    memory_mib: Positive
    seq: Annotated[
        Positive,
        _doc("Its arrival number on the host (first come, first served among equal priorities)."),
    ]
    since: Annotated[Timestamp, _doc("When it joined.")]
    waiting_s: Seconds
    holder: Annotated[
        Lease,
        _doc(
            "The waiting gpuctl run process; `expires` is its heartbeat's term (renewed on "
            "every look): a dead holder's entry is void."
        ),
    ]


class VoidedHolder(Struct, forbid_unknown_fields=True):
    host: str
    pid: Annotated[NonNeg, _doc("0: unknown (a `more` row, an unreadable copy).")]


class Voided(Struct, forbid_unknown_fields=True):
    host: Annotated[str, _doc("The configured host that lists it.")]
    kind: Annotated[
        Literal["lease", "inflight", "queue", "more"],
        _doc(
            "A record's lease (a service's, `_reclaim`'s, `_admission`'s), an in-flight "
            "entry, a queue entry; `more`: one row counting the copies not read."
        ),
    ]
    service: Annotated[
        str,
        _doc(
            "The record or in-flight service it is on (`_queue` for a queue entry, `*` for `more`)."
        ),
    ]
    file: Annotated[
        str,
        _doc(
            "Where it is under the state folder: `records/<service>.json` (still in force in "
            "the file), or a kept copy `<name>.json.void-<time>`."
        ),
    ]
    holder: VoidedHolder
    at: Annotated[
        str | None,
        _doc(
            "When it was set aside (a lease still in its record: when it was granted), ISO "
            "8601 UTC."
        ),
    ]
    why: Annotated[
        str,
        _doc(
            "Why it is void: `term longer than N s`, `holder at pid 1`, `holder without a "
            "start time on this host`."
        ),
    ]


class LocksOutput(Struct):
    schema: Literal[1]
    ok: Annotated[bool, _doc("Every host's records were read.")]
    records: list[Annotated[dict[str, Any], _one_of("LocksRecord", "LocksUnreadable", key="oneOf")]]
    set_aside: Annotated[
        list[SetAside],
        _doc("Record files set aside as unreadable, per host (they do not make `ok` false)."),
    ]
    queue: Annotated[
        list[Waiter],
        _doc("Each host's wait queue (`gpuctl run --wait`), in the order it will be served."),
    ]
    hidden_jobs: Annotated[
        NonNeg,
        _doc(
            "How many records of `gpuctl run` jobs that ended (stopped or preempted, nothing "
            "held) more than an hour ago were left out of `records`; `gpuctl locks --finished` "
            "lists them (0 then)."
        ),
    ]
    voided: Annotated[
        list[Voided],
        _doc(
            "Leases and in-flight and queue entries found forged, per host: each counts for "
            "nothing, and is kept for a person until removed (they do not make `ok` false)."
        ),
    ]


# --- reclaim --json ----------------------------------------------------------------------


class ReclaimHost(Struct):
    """One host."""

    name: str
    ok: Annotated[
        bool, _doc("Its records and GPU could be read; when not, nothing was stopped there.")
    ]
    error: str | None
    hint: str | None
    skipped: Annotated[str | None, _doc("Why the host was left alone: another reclaim runs there.")]


class Candidate(Struct):
    """One service and what reclaim did with it."""

    host: str
    service: str
    action: Annotated[
        Literal["stop", "sleep", "unload", "touch", "keep"],
        _doc(
            "stop, sleep (vLLM sleep mode) and unload (Ollama) free memory; touch: busy past "
            "its timeout, so in use; keep: nothing to do."
        ),
    ]
    reason: Annotated[
        str,
        _doc('Why, e.g. "idle 41m > 30m", "in flight: 2 requests", "lease held by ...".'),
    ]
    idle_s: Annotated[Seconds | None, _doc("Seconds since its last use; null when never used.")]
    done: Annotated[bool, _doc("The action was carried out (never with --dry-run).")]
    error: Annotated[str | None, _doc("Why the action failed.")]
    hint: str | None
    pool: PoolHosts


class Resumed(Struct):
    host: Annotated[str, _doc("The host's name from the config.")]
    service: Annotated[str, _doc("The service.")]
    outcome: Annotated[
        Outcome | None,
        _doc(
            "How its ensure (without preemption) ended; null in a dry run or when it could "
            "not be tried."
        ),
    ]
    reason: Annotated[str, _doc("Why, in words.")]
    started: Annotated[bool, _doc("It was started (or found ready).")]
    dry_run: Annotated[bool, _doc("A dry run: it would be tried.")]


class ReclaimOutput(Struct):
    schema: Literal[1]
    dry_run: bool
    exit_code: Annotated[
        Literal[0, 1, 4],
        _doc("0 everything planned was done, 1 a stop failed, 4 a host could not be read."),
    ]
    hosts: list[ReclaimHost]
    candidates: list[Candidate]
    rotated_logs: Annotated[
        list[str], _doc("Launchers' logs on this machine rotated by size in this run.")
    ]
    resumed: Annotated[
        list[Resumed],
        _doc(
            "Preempted services with resume = true that reclaim tried to bring back after its "
            "stops, highest priority first."
        ),
    ]


# --- ensure --json, stop --json ----------------------------------------------------------


class EnsureOutput(Struct):
    schema: Literal[1]
    service: str
    host: str
    outcome: Outcome
    exit_code: Annotated[
        Literal[0, 1, 3, 4, 5, 130],
        _doc("0 ready/started/loading, 1 failed, 3 busy, 4 unknown, 5 timeout, 130 interrupted."),
    ]
    reason: str
    decision: Annotated[str, _doc("What it first found (a status decision, e.g. FITS).")]
    launched: Annotated[bool, _doc("This call launched the server.")]
    waited_s: Seconds
    attempt: Annotated[Attempt | None, _doc("The start this call made, if any.")]
    log_tail: Annotated[
        str,
        _doc("The last lines of the server's log, when it failed or timed out; else empty."),
    ]
    handle: Handle | None
    notes: list[str]
    hint: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        _doc(
            "What the user can do about a refusal; null when there is nothing to do (as in status)."
        ),
    ]
    pool: Annotated[
        list[str],
        _doc(
            "The service's hosts (`hosts = [...]`), in the config's order; `host` is the one "
            "chosen. A service on one host lists it alone."
        ),
    ]


class StopOutput(Struct):
    schema: Literal[1]
    service: str
    host: str
    stopped: Annotated[
        list[str],
        _doc(
            "What was stopped (a process, a container, a terminal), one entry each; empty "
            "when nothing ran."
        ),
    ]
    reason: str
    exit_code: NonNeg


# --- the published files -----------------------------------------------------------------


class Output(msgspec.Struct, frozen=True):
    """One ``schemas/<name>.schema.json``: its top-level Struct, the Structs its unions
    name, and what the file says about it."""

    name: str
    struct: type[Struct]
    title: str
    description: str
    extra: tuple[type[Struct], ...] = ()


OUTPUTS = (
    Output(
        "status",
        StatusOutput,
        "gpuctl status --json",
        "What runs on each GPU host and each service's decision. Printed whatever the exit "
        "code (0: every host answered, 4: a host is UNKNOWN).",
    ),
    Output(
        "locks",
        LocksOutput,
        "gpuctl locks --json",
        "Every service's record and lease, per host. A host whose records could not be "
        "read has one row with its error.",
        (LocksRecord, LocksUnreadable, Attempt, Repair),
    ),
    Output(
        "reclaim",
        ReclaimOutput,
        "gpuctl reclaim --json",
        "One reclaim run: each host it read, and every configured service of those hosts "
        "as a candidate with the action taken (or, with --dry-run, planned) and why.",
    ),
    Output(
        "ensure",
        EnsureOutput,
        "gpuctl ensure SERVICE --json",
        "How an ensure ended. Printed whatever the exit code (exit_code repeats it).",
    ),
    Output("stop", StopOutput, "gpuctl stop SERVICE --json", "What a stop did."),
    Output(
        "events",
        EventsOut,
        "gpuctl events --json",
        "The host's journal, oldest first: one row per event, with its words as the lines "
        "print them, and one error row per host that could not be read.",
    ),
    Output(
        "usage",
        UsageOut,
        "gpuctl usage --json",
        "What each service, user or UTC day held and cost over the window: GiB-hours "
        "(null when some of the time had no budget), cold starts, idle time, preemptions.",
    ),
)

# Objects whose other keys depend on something else (a launcher's handle): their schema
# lets them through (``additionalProperties: true``).
OPEN = (Handle,)

# The name each Struct has under ``$defs`` (what the published files have always called it).
DEF_NAMES = {
    "StatusMig": "mig",
    "StatusDevice": "device",
    "StatusProcess": "process",
    "StatusStarting": "starting",
    "StatusIdentity": "identity",
    "StatusHost": "host",
    "StatusOther": "other",
    "StatusVictim": "victim",
    "StatusHolder": "holder",
    "StatusService": "service",
    "Attempt": "attempt",
    "Handle": "handle",
    "Lease": "lease",
    "Failure": "failure",
    "Promise": "promise",
    "Repair": "repair",
    "LocksRecord": "record",
    "LocksUnreadable": "unreadable",
    "SetAside": "setAside",
    "Waiter": "waiter",
    "VoidedHolder": "voidedHolder",
    "Voided": "voided",
    "ReclaimHost": "host",
    "Candidate": "candidate",
    "Resumed": "resumed",
    "EventRow": "event",
    "HostError": "hostError",
    "UsageRow": "usageRow",
}

SCHEMAS_DIR = Path(__file__).resolve().parents[2] / "schemas"
REGENERATE = "python -m gpuctl.render.schemas"


def json_schema(out: Output) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one output, its Structs under ``$defs``."""
    _, components = msgspec.json.schema_components(
        (out.struct, *out.extra), ref_template="#/$defs/{name}"
    )
    open_names = {c.__name__ for c in OPEN}
    root = components.pop(out.struct.__name__)
    defs: dict[str, Any] = {}
    for name, schema in components.items():
        schema.pop("title", None)
        if name in open_names:
            schema["additionalProperties"] = True
        defs[DEF_NAMES[name]] = schema
    root.pop("title", None)
    doc: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:gpuctl:schema:{out.name}:1",
        "title": out.title,
        "description": out.description,
    }
    if defs:
        doc["$defs"] = defs
    doc.update(root)
    text = re.sub(
        r'"#/\$defs/([A-Za-z]+)"',
        lambda m: json.dumps(f"#/$defs/{DEF_NAMES[m.group(1)]}"),
        json.dumps(doc),
    )
    result: dict[str, Any] = json.loads(text)
    return result


def rendered(out: Output) -> str:
    """The file's text: 2-space indent, a final newline."""
    return json.dumps(json_schema(out), indent=2, ensure_ascii=False) + "\n"


def stale(directory: Path = SCHEMAS_DIR) -> list[str]:
    """The files under ``directory`` that differ from a fresh generation."""
    out = []
    for o in OUTPUTS:
        path = directory / f"{o.name}.schema.json"
        if not path.exists() or path.read_text() != rendered(o):
            out.append(path.name)
    return out


def main(argv: list[str]) -> int:
    if argv[1:] == ["--check"]:
        bad = stale()
        for name in bad:
            print(f"schemas/{name} is stale: run `{REGENERATE}`", file=sys.stderr)
        return 1 if bad else 0
    if argv[1:]:
        print(f"usage: {REGENERATE} [--check]", file=sys.stderr)
        return 2
    for o in OUTPUTS:
        (SCHEMAS_DIR / f"{o.name}.schema.json").write_text(rendered(o))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
