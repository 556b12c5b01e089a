"""The journal's events: one thing gpuctl did or saw on a host, in words a person reads.

An event says when, which service or job, its kind (and for a stop, its cause), the
phase before and after, who (what the caller says: entry point, user, pid, host; plus,
for a write through the agent, what the agent saw: the peer's address and the token's
role), why (the decision and its reason, in ``status``'s words) and its figures (budget,
memory seen, durations). Commands and reasons are redacted before they are kept
(``core.redact``).

The journal is a record of what gpuctl did, not proof: anyone with the write token, or a
member of the state folder's group, can write an event of their choosing.
"""

from __future__ import annotations

import enum
import math
import re
from typing import Any

import msgspec
from msgspec.structs import replace

from gpuctl.core.record import TIME_MAX
from gpuctl.core.redact import redact_lines
from gpuctl.core.units import format_duration


class Kind(enum.Enum):
    ADMIT = "admit"
    REFUSE = "refuse"
    QUEUE = "queue"
    LAUNCH = "launch"
    READY = "ready"
    FAIL = "fail"
    STOP = "stop"
    WAKE = "wake"
    RESUME = "resume"
    REPAIR = "repair"
    SET_ASIDE = "set_aside"
    LEASE = "lease"
    PROXY = "proxy"


class Cause(enum.Enum):
    """Why a stop happened."""

    MANUAL = "manual"
    IDLE = "idle"
    PREEMPTED = "preempted"
    YIELD = "yield"
    SLEEP = "sleep"


_KINDS = {k.value: k for k in Kind}
_CAUSES = {c.value: c for c in Cause}

# Bounds on what one event may carry: a forged or runaway event never bloats the journal.
MAX_TEXT = 500
MAX_FIGURES = 16
MAX_WHO = 8


def _text(value: object, limit: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    if len(value) > limit:
        raise ValueError(f"{len(value)} characters, at most {limit}")
    return redact_lines(value)


def _opt_text(value: object, limit: int = MAX_TEXT) -> str | None:
    return None if value is None else _text(value, limit)


class Event(msgspec.Struct, frozen=True):
    """One journal event. ``service`` names a service or a ``gpuctl run`` job (``job``
    says which); ``figures`` are numbers only (MiB, seconds, counts); ``who`` is short
    text only (entry, user, pid, host, peer, role)."""

    at: float
    kind: Kind
    service: str
    host: str = ""
    cause: Cause | None = None
    job: bool = False
    before: str | None = None
    after: str | None = None
    decision: str | None = None
    reason: str | None = None
    by: str | None = None  # the other party: who preempted it, whose lease was broken
    command: str | None = None
    who: dict[str, str] = msgspec.field(default_factory=dict)
    figures: dict[str, float] = msgspec.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"at": round(self.at, 6), "kind": self.kind.value}
        out["service"] = self.service
        if self.host:
            out["host"] = self.host
        if self.cause is not None:
            out["cause"] = self.cause.value
        if self.job:
            out["job"] = True
        for key in ("before", "after", "decision", "reason", "by", "command"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.who:
            out["who"] = dict(self.who)
        if self.figures:
            out["figures"] = dict(self.figures)
        return out

    def seen_by(self, **more: str) -> Event:
        """With what the agent saw added to ``who`` (its peer, the token's role): the
        caller's own words for those keys are replaced."""
        return replace(self, who={**self.who, **{k: v[:100] for k, v in more.items()}})


def event_from_dict(data: object, *, stored: bool = False) -> Event:
    """An event from its JSON form, checked and bounded (a bad one: ValueError naming
    the field). Text is redacted again: the journal never trusts its writer for that.
    ``stored``: read back from the journal, where it was checked and redacted as it
    went in (and the agent may have added to ``who``): only its shape is checked."""
    if stored and isinstance(data, dict):
        return _stored(data)
    if not isinstance(data, dict):
        raise ValueError("event: must be an object")
    unknown = sorted(str(k) for k in data if k not in _FIELDS)
    if unknown:
        raise ValueError(f"event.{unknown[0][:40]}: unknown field")

    def field_of(key: str, check: Any) -> Any:
        try:
            return check(data.get(key))
        except (ValueError, TypeError) as e:
            raise ValueError(f"event.{key}: {e}") from None

    at = field_of("at", _time)
    kind = field_of("kind", Kind)
    service = field_of("service", lambda v: _text(v, 64))
    cause = field_of("cause", lambda v: None if v is None else Cause(v))
    who = field_of("who", _who)
    figures = field_of("figures", _figures)
    job = data.get("job", False)
    if not isinstance(job, bool):
        raise ValueError("event.job: must be true or false")
    texts = {
        k: field_of(k, _opt_text)
        for k in ("before", "after", "decision", "reason", "by", "command")
    }
    host = field_of("host", lambda v: _opt_text(v, 100)) or ""
    return Event(at, kind, service, host, cause, job, **texts, who=who, figures=figures)


def _stored(d: dict[str, Any]) -> Event:
    """A stored event, its shape checked (ValueError or TypeError when it is not one):
    a member of the state folder's group can write any row, and a reader must not fail
    on it, nor hand it on (``NaN``, a year past 2100, a number where text goes)."""

    def text(key: str) -> str | None:
        value = d.get(key)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"event.{key}: must be text")
        return value

    service, host = text("service"), text("host")
    if service is None:
        raise KeyError("service")
    cause, job = d.get("cause"), d.get("job", False)
    who, figures = d.get("who") or {}, d.get("figures") or {}
    if not isinstance(job, bool) or not isinstance(who, dict) or not isinstance(figures, dict):
        raise TypeError("event: job, who or figures of the wrong kind")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in who.items()):
        raise TypeError("event.who: must map text to text")
    if not all(isinstance(k, str) for k in figures):
        raise TypeError("event.figures: must map text to numbers")
    return Event(
        _time(d["at"]),
        _KINDS[d["kind"]],
        service,
        host or "",
        _CAUSES[cause] if cause is not None else None,
        job,
        text("before"),
        text("after"),
        text("decision"),
        text("reason"),
        text("by"),
        text("command"),
        dict(who),
        {k: _number(v) for k, v in figures.items()},
    )


_FIELDS = frozenset(
    {"at", "kind", "service", "host", "cause", "job", "before", "after", "decision", "reason",
     "by", "command", "who", "figures"}
)  # fmt: skip


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    try:
        out = float(value)
    except OverflowError:  # an integer of hundreds of digits: JSON allows it
        raise ValueError("must be finite") from None
    if not math.isfinite(out):
        raise ValueError("must be finite")
    return out


def _time(value: object) -> float:
    out = _number(value)
    if not 0 <= out <= TIME_MAX:
        raise ValueError(f"must be a Unix time from 0 to {TIME_MAX:.0f}")
    return out


def _who(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_WHO:
        raise ValueError(f"must be an object of at most {MAX_WHO} keys")
    return {_text(k, 32): _text(v, 100) for k, v in value.items()}


def _figures(value: object) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_FIGURES:
        raise ValueError(f"must be an object of at most {MAX_FIGURES} numbers")
    return {_text(k, 32): _number(v) for k, v in value.items()}


def words(e: Event) -> str:
    """The event as one line a person reads, without its time: "photos stopped
    (preempted by chat) — alice via proxy"."""
    what = e.service + (" (job)" if e.job else "")
    f = e.figures
    if e.kind is Kind.STOP:
        cause = e.cause.value if e.cause else ""
        if e.cause is Cause.PREEMPTED:
            text = f"{what} preempted" + (f" by {e.by}" if e.by else "")
        elif e.cause is Cause.IDLE:
            idle = f.get("idle_s")
            text = f"{what} stopped: idle" + (
                f" for {format_duration(idle)}" if idle is not None else ""
            )
        elif e.cause is Cause.SLEEP:
            text = f"{what} put to sleep"
        else:
            text = f"{what} stopped" + (f" ({cause})" if e.cause else "")
    elif e.kind is Kind.READY:
        cold = f.get("cold_start_s")
        text = f"{what} ready" + (
            f" after a {format_duration(cold)} cold start" if cold is not None else ""
        )
    elif e.kind is Kind.FAIL:
        code = f.get("exit_code")
        text = f"{what} failed" + (f" (exit {int(code)})" if code is not None else "")
        if f.get("oom"):
            text += ", out of memory"
    elif e.kind is Kind.LAUNCH:
        text = f"{what} launched"
        if "budget_mib" in f:
            text += f" ({_gib(f['budget_mib'])} budget)"
    elif e.kind is Kind.PROXY and "requests_served" in f:
        period = f.get("period_s")
        text = f"{what} served {int(f['requests_served'])} request(s) through the proxy" + (
            f" in {format_duration(period)}" if period is not None else ""
        )
    elif e.kind is Kind.PROXY:
        held = f.get("requests_held")
        text = f"{what} cold start through the proxy" + (
            f", {int(held)} request(s) held" if held is not None else ""
        )
    else:
        verb = {
            Kind.ADMIT: "admitted",
            Kind.REFUSE: "refused",
            Kind.QUEUE: "queue",
            Kind.WAKE: "woken",
            Kind.RESUME: "resumed",
            Kind.REPAIR: "record repaired",
            Kind.SET_ASIDE: "record set aside",
            Kind.LEASE: "lease",
        }[e.kind]
        text = f"{what} {verb}"
        if e.by:
            text += f" ({e.by})"
    if e.reason:
        text += f": {e.reason}" if e.kind is not Kind.STOP or e.cause is None else f" — {e.reason}"
    actor = e.who.get("user") or ""
    entry = e.who.get("entry") or ""
    if actor or entry:
        text += " — " + " via ".join(p for p in (actor, entry) if p)
    return text


def _gib(mib: float) -> str:
    return f"{mib / 1024:.0f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"([0-9]{1,12}(?:\.[0-9]{1,6})?)([smhdw])")
_COMPOUND = re.compile(r"(?:[0-9]{1,12}(?:\.[0-9]{1,6})?[smhdw])+")


def parse_since(text: str, now: float) -> float:
    """``2h``, ``30m``, ``7d``, ``1w``, or a sum of them as durations elsewhere are written
    (``1h30m``), before ``now``, or a Unix time (``1767225600``): the time it names, never
    before 1970 (``999999999999d`` is from the start: no clock shows the day before).
    ValueError for anything else."""
    text = text.strip().lower()
    if len(text) <= 64 and _COMPOUND.fullmatch(text) and len(_PART.findall(text)) > 1:
        span = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
        return max(0.0, now - span)
    if text and text[-1] in _UNITS:
        amount = float(text[:-1])
        if not math.isfinite(amount) or amount < 0:
            raise ValueError(f"not a span of time: {text!r}")
        return max(0.0, now - amount * _UNITS[text[-1]])
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"not a time: {text!r}")
    return value
