"""Which health URLs the agent may fetch: this machine's own addresses, on the ports it is told.

A token holder writes a record's ``health``; the agent fetches it, and the record's phase
then says whether it answered 200. Fetched anywhere, that lets a token holder make the
agent ask hosts its network trusts it for (request forgery), and read one bit of each
answer (a port scan). So the agent fetches a health URL only when:

- its host is an IP literal of this machine (loopback, an address of one of its
  interfaces, or the unspecified ``0.0.0.0``/``::``, which Linux connects to loopback: a
  user who copied vLLM's "running on http://0.0.0.0:8000") or the name ``localhost``.
  Any other name is refused without resolving it: its DNS answer could change between
  the check and the fetch (DNS rebinding);
- its port (or the scheme's, 80 or 443) is in ``--health-ports``.

A refused URL is never fetched, and says nothing about the server: its record's phase is
left as it is.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from urllib.parse import urlsplit

import msgspec

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# The ports model servers listen on by default: vLLM, TGI, Triton, llama.cpp, Jupyter
# (8000-8999), Ollama (11434), SGLang (30000). Another port is named with --health-ports.
DEFAULT_HEALTH_PORTS = "8000-8999,11434,30000"
_MAX_RANGES = 64


class PortRanges(msgspec.Struct, frozen=True):
    """Inclusive port ranges, e.g. ``8000-8100,9000``; empty: no port at all."""

    ranges: tuple[tuple[int, int], ...] = ()

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and any(lo <= port <= hi for lo, hi in self.ranges)

    def __str__(self) -> str:
        if not self.ranges:
            return "none"
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges)


def parse_ports(text: str) -> PortRanges:
    """``8000-8100,9000`` (or ``none``) as ``PortRanges``; ValueError saying what is wrong."""
    spec = text.strip().lower()
    if spec == "none":
        return PortRanges()
    parts = [p.strip() for p in spec.split(",")]
    if not spec or len(parts) > _MAX_RANGES:
        raise ValueError(f"expected up to {_MAX_RANGES} ports or ranges like 8000-8100,9000")
    ranges: list[tuple[int, int]] = []
    for part in parts:
        lo_text, dash, hi_text = part.partition("-")
        bounds = (lo_text.strip(), hi_text.strip() if dash else lo_text.strip())
        if not all(b.isdigit() and len(b) <= 5 for b in bounds):
            raise ValueError(f"{part[:40]!r} is not a port or a range like 8000-8100")
        lo, hi = int(bounds[0]), int(bounds[1])
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"{part[:40]!r}: ports are 1 to 65535, the low one first")
        ranges.append((lo, hi))
    return PortRanges(tuple(sorted(set(ranges))))


def _literal(host: str, bracketed: bool) -> IpAddress | None:
    """The IP literal ``host`` names, or None for a name. A zone (``%eth0``) is cut only
    from an IPv6 literal in brackets, where it names an interface, not an address;
    elsewhere ``%`` is part of the host, so ``127.0.0.1%x.evil.com`` is a name, never
    loopback (a resolver, or a later parser, may read it as one)."""
    if bracketed:
        host = host.split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class HealthReach(msgspec.Struct, frozen=True):
    """The agent's rule for health URLs (module docstring)."""

    ports: PortRanges

    def refusal(self, url: str, local: Collection[IpAddress]) -> str | None:
        """Why the agent must not fetch ``url``, or None when it may. ``local``: this
        machine's interface addresses (loopback and unspecified ones count anyway)."""
        try:
            parts = urlsplit(url)
            port = parts.port
            host = parts.hostname
        except ValueError:
            return "not a URL the agent can read"
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not host:
            return "not an http(s) URL with a host"
        if port is None:
            port = 443 if scheme == "https" else 80
        # The netloc's host part starts with "[" only for an IPv6 literal.
        ip = _literal(host, parts.netloc.rpartition("@")[2].startswith("["))
        if ip is None:
            if host.lower().rstrip(".") != "localhost":
                return (
                    f"its host {host[:80]!r} is a name: the agent fetches only IP literals "
                    "of this machine and localhost"
                )
        elif not (ip.is_loopback or ip.is_unspecified or ip in local):
            return f"{ip} is not an address of this machine"
        if port not in self.ports:
            return f"port {port} is not in the agent's --health-ports ({self.ports})"
        return None
