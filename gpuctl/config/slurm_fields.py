"""The Slurm launcher's keys: the ``[hosts.NAME.slurm]`` table, checked at load as
``sbatch`` would check them at submission, and what a ``slurm`` service may not set.

``health`` of a Slurm service may name ``{node}``, the node Slurm chose: it is checked
here as a URL with a placeholder host, and expanded each time ``ensure`` asks the server
(``adapters.launchers.slurm``), which then records the expanded URL as the record's
``health`` (``node_of_url`` tells a stored URL from anything else); ``status`` reads
that, never squeue. ``url`` may not: the proxy uses it as written, so a ``{node}``
there would reach no server."""

from __future__ import annotations

import re
from typing import Any

from gpuctl.config.table import Table, check_url
from gpuctl.config.values import ServiceConfig, SlurmConfig
from gpuctl.errors import ConfigError

SLURM_KEYS = (
    "partition",
    "account",
    "time_limit",
    "gpus",
    "nice",
    "qos",
    "sbatch",
    "squeue",
    "scancel",
)
NODE = "{node}"
# Slurm's own names (partition, account, QOS): letters, digits and a few marks; nothing
# a shell or sbatch's option parser would read as more than one word.
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", re.ASCII)
_COMMAND = re.compile(r"[^\s\x00-\x1f]+")
# sbatch's --nice takes -2147483645..2147483645; only root may lower it below 0.
_NICE_MAX = 2147483645
_GPUS_MAX = 64


def parse_slurm(where: str, raw: Any) -> SlurmConfig | None:
    """``[hosts.NAME.slurm]``, or None when the host has none."""
    if raw is None:
        return None
    t = Table(where, raw, SLURM_KEYS)
    limit = t.get("time_limit")
    return SlurmConfig(
        partition=t.pattern("partition", _SLURM_NAME, "a Slurm partition name"),
        account=t.pattern("account", _SLURM_NAME, "a Slurm account name"),
        time_limit_s=t.duration("time_limit", 0.0) if limit is not None else None,
        gpus=t.int_("gpus", 1, 0, _GPUS_MAX),
        nice=t.int_("nice", 0, -_NICE_MAX, _NICE_MAX) if t.get("nice") is not None else None,
        qos=t.pattern("qos", _SLURM_NAME, "a Slurm QOS name"),
        sbatch=t.pattern("sbatch", _COMMAND, "a command or path, e.g. /usr/bin/sbatch") or "sbatch",
        squeue=t.pattern("squeue", _COMMAND, "a command or path, e.g. /usr/bin/squeue") or "squeue",
        scancel=t.pattern("scancel", _COMMAND, "a command or path, e.g. /usr/bin/scancel")
        or "scancel",
    )


def node_url(s: Table, key: str, schemes: tuple[str, ...], launcher: str | None) -> str | None:
    """A URL that a ``slurm`` service may write with ``{node}`` for its host part (its
    ``health`` only)."""
    v = s.str_(key)
    if v is None:
        return None
    if NODE not in v:
        return check_url(s.loc(key), v, schemes)
    if key != "health":
        raise s.fail(
            key,
            f"{NODE} works in health only: {key} is used as written, so it would reach no server",
            hint=f"write the server's host name in {key}, or leave {key} out",
        )
    if launcher != "slurm":
        raise s.fail(
            key,
            f'{NODE} names the node Slurm chose; only a launcher = "slurm" service has one',
            hint='set launcher = "slurm", or write the host name',
        )
    check_url(s.loc(key), v.replace(NODE, "node"), schemes)
    return v


def check_slurm_service(svc: ServiceConfig, slurm: SlurmConfig | None, host: str) -> None:
    """What a ``slurm`` service needs: a command, and its host's ``slurm`` table."""
    where = f"services.{svc.name}"
    if svc.launcher != "slurm":
        return
    if not svc.command:
        raise ConfigError(f"{where}.command: missing (the slurm launcher needs a command)")
    if slurm is None:
        raise ConfigError(
            f"{where}.launcher: 'slurm' needs a [hosts.{host}.slurm] table",
            hint=f"add [hosts.{host}.slurm] (partition, account, time_limit; all optional)",
        )
    if svc.stop == "sleep":
        raise ConfigError(
            f"{where}.stop: 'sleep' keeps a job holding its GPUs; a Slurm job is cancelled",
            hint='drop stop, or use stop = "stop"',
        )


# A node name that can stand for the host part of a URL (as the launcher checks
# squeue's answer): nothing a URL would read as a user, a port, a path or a second host.
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*", re.ASCII)


def names_node(url: str | None) -> bool:
    """Whether ``url`` is a template that needs the node Slurm chose."""
    return url is not None and NODE in url


def node_of_url(template: str, url: str | None) -> str | None:
    """The node ``url`` is ``template`` expanded with, or None where it is not one: a
    record's stored URL is trusted only as the service's own template with a plain host
    name in place of ``{node}`` (a record is anyone's to write; a URL it names must not
    send a health request anywhere else)."""
    if url is None or template.count(NODE) != 1:
        return None
    head, _, tail = template.partition(NODE)
    if len(url) <= len(head) + len(tail) or not url.startswith(head) or not url.endswith(tail):
        return None
    node = url[len(head) : len(url) - len(tail)]
    return node if _NODE_NAME.fullmatch(node) else None
