"""Network namespaces the tests create themselves, to put a test host behind a link they
can cut: ``ip netns add gpuctl-t-<random>``, a veth pair, and a link-local /30 (our side
``.1``, the namespace's side ``.2``) that overlaps no address or route of this machine.

Traffic goes only to the namespace's address, over our own veth: ``cut`` checks that the
kernel still routes it there, so a cut link never sends a packet out of a real interface.

The cut is a black hole, not a refusal: the veth inside the namespace goes down, and our
side's neighbour entry for the namespace's address is pinned (``nud permanent``), so no
ARP failure turns the silence into "no route to host". A client's SYN is dropped at our
veth (no carrier) and it waits for its own timeout, as across a real partition. (``tc
netem loss 100%`` would do the same, but this kernel has no netem.)
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpuctl.sim.host import SimHost

# The link-local block the /30s are drawn from (RFC 3927: never routed off a link).
_BLOCK = ipaddress.ip_network("169.254.192.0/18")


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")
    return p.stdout


@functools.cache
def unavailable() -> str | None:
    """Why namespaces cannot be made here (for a skip), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    p = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False
    )
    if p.returncode != 0:
        return f"ip netns does not work here: {p.stderr.strip()[:200]}"
    for conf in ("all", "default"):
        flag = Path(f"/proc/sys/net/ipv4/conf/{conf}/ignore_routes_with_linkdown")
        if flag.exists() and flag.read_text().strip() != "0":
            # A cut link's route would be ignored, and the traffic would take the default
            # route out of a real interface.
            return f"{flag} is set: a cut veth's route would be ignored"
    return None


def _taken() -> list[ipaddress.IPv4Network]:
    """This machine's IPv4 networks: its addresses' and its routes'."""
    nets = []
    for line in _ip("-4", "-o", "addr", "show").splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all").splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
            dest = line.split()[1] if dest != "default" else ""
        with contextlib.suppress(ValueError):
            if dest:
                nets.append(ipaddress.ip_network(dest, strict=False))
    return nets


def _free_subnet() -> ipaddress.IPv4Network:
    taken = _taken()
    subnets = list(_BLOCK.subnets(new_prefix=30))
    for _ in range(64):
        net = subnets[secrets.randbelow(len(subnets))]
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"no free /30 in {_BLOCK}")


@dataclass
class Netns:
    """A namespace joined to us by a veth pair: ``ours`` on our side, ``inside`` in it."""

    name: str
    outer: str
    inner: str
    ours: str
    inside: str
    cut_now: bool = False

    def exec_prefix(self) -> list[str]:
        """The command that runs the rest of a command line inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        """Black-hole the link: packets to ``inside`` are dropped, never refused."""
        mac = _ip("-o", "link", "show", self.inner, netns=self.name).split("link/ether")[1]
        _ip(
            "neigh", "replace", self.inside, "lladdr", mac.split()[0], "dev", self.outer,
            "nud", "permanent",
        )  # fmt: skip
        _ip("link", "set", self.inner, "down", netns=self.name)
        self.cut_now = True
        route = _ip("-o", "route", "get", self.inside)
        if f"dev {self.outer} " not in route + " ":
            self.heal()
            raise RuntimeError(f"the cut link is not routed over {self.outer}: {route.strip()}")

    def heal(self) -> None:
        """Bring the link back as it was made (ARP as usual)."""
        _ip("link", "set", self.inner, "up", netns=self.name)
        _ip("neigh", "del", self.inside, "dev", self.outer, check=False)
        self.cut_now = False


@contextlib.contextmanager
def netns() -> Iterator[Netns]:
    """A fresh namespace and veth pair, removed on the way out whatever happened."""
    tag = secrets.token_hex(4)
    net = _free_subnet()
    ours, inside = (str(a) for a in list(net.hosts())[:2])
    ns = Netns(f"gpuctl-t-{tag}", f"gt{tag}o", f"gt{tag}i", ours, inside)
    try:
        _ip("netns", "add", ns.name)
        _ip("link", "add", ns.outer, "type", "veth", "peer", "name", ns.inner)
        _ip("link", "set", ns.inner, "netns", ns.name)
        _ip("addr", "add", f"{ours}/30", "dev", ns.outer)
        _ip("link", "set", ns.outer, "up")
        _ip("addr", "add", f"{inside}/30", "dev", ns.inner, netns=ns.name)
        _ip("link", "set", ns.inner, "up", netns=ns.name)
        _ip("link", "set", "lo", "up", netns=ns.name)
        yield ns
    finally:
        # Deleting one end of a veth deletes the pair (and the neighbour entry with it).
        _ip("link", "del", ns.outer, check=False)
        _ip("netns", "del", ns.name, check=False)


@dataclass
class NetnsSimHost(SimHost):
    """A simulated host whose processes (its agent first) run inside ``ns``, listening on
    its address; its simulated GPU's folder is a folder like any other."""

    ns: Netns | None = field(default=None, kw_only=True)

    def command_prefix(self) -> list[str]:
        assert self.ns is not None
        return self.ns.exec_prefix()
