"""The web view's backend (``gpuctl.agent.ui.UiBackend``): the config's view of this
GPU host, and the flows behind the page's buttons, the same the CLI runs.

The config given to ``gpuctl agent`` is the GPU host's own: its services run here, so
every host it names is read and acted on through this machine's probe and state
directory (never over HTTP back to this agent). The journal names the page as the actor
(``who.entry`` = ``ui``).

Without a config the page shows what the records hold and may stop a recorded server:
a stop signals only a server that carries its start's proof (``Launcher.stop``), and
nothing here ever runs a command taken from a record.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from gpuctl.config.values import Config, HostConfig, ServiceConfig
from gpuctl.errors import GpuctlError
from gpuctl.flows.deps import EnsureRequest, LocalProbeOptions

ENTRY = "ui"


class ConfigBackend:
    """``UiBackend`` over a config (maybe empty: then ``has_config`` is False)."""

    def __init__(
        self,
        config: Config,
        *,
        probe: str,
        sim_dir: Path | None,
        gpu_memory_mib: int | None,
        state_dir: Path,
    ) -> None:
        self.local = LocalProbeOptions(probe=probe, sim_dir=sim_dir, gpu_memory_mib=gpu_memory_mib)
        self.state_dir = state_dir
        self.has_config = bool(config.services)
        self.config = replace(
            config,
            hosts={name: self._here(h) for name, h in config.hosts.items()},
        )
        # One action per service at a time: a second click waits, the flows' leases
        # decide between the page and the CLI.
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _here(self, h: HostConfig) -> HostConfig:
        return replace(
            h,
            agent=None,
            probe=self.local.probe,
            sim_dir=self.local.sim_dir,
            gpu_memory_mib=self.local.gpu_memory_mib or h.gpu_memory_mib,
        )

    def status(self) -> dict[str, Any] | None:
        if not self.has_config:
            return None
        from gpuctl.flows.status import status
        from gpuctl.render.status_json import status_to_json
        from gpuctl.wiring.build import status_deps

        deps = status_deps(self.config, local=self.local)
        try:
            return status_to_json(status(deps))
        finally:
            deps.close()

    def act(
        self, op: str, service: str, seen: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        from gpuctl.flows.story import seen_as

        with self._guard:
            lock = self._locks.setdefault(service, threading.Lock())
        with lock, seen_as(seen or {}):
            try:
                return self._act(op, service)
            except GpuctlError as err:
                return 409, {"ok": False, "message": err.message, "hint": err.hint or ""}

    def _act(self, op: str, service: str) -> tuple[int, dict[str, Any]]:
        from gpuctl.wiring.build import deps_for

        if service in self.config.services:
            config = self.config
        elif op != "stop":
            hint = (
                "start the agent with --config (or $GPUCTL_CONFIG) naming it"
                if not self.has_config
                else f"add services.{service} to the agent's config"
            )
            return 404, {
                "ok": False,
                "message": f"{service} is not in the agent's config: "
                "the page never starts a command taken from a record",
                "hint": hint,
            }
        else:
            only = self._record_only(service)
            if only is None:
                return 404, {"ok": False, "message": f"{service} has no record here", "hint": ""}
            config = only
        deps = deps_for(config, service)
        try:
            if op == "stop":
                from gpuctl.flows import service_ops
                from gpuctl.render.results import stop_text

                stopped = service_ops.stop(deps, entry=ENTRY)
                return 200, {
                    "ok": stopped.exit_code == 0,
                    "message": "\n".join(stop_text(stopped)),
                }
            from gpuctl.render.results import ensure_text

            if op == "resume":
                from gpuctl.flows.resume import resume

                result = resume(deps, EnsureRequest(entry=ENTRY, wait=False))
            else:
                from gpuctl.flows.ensure.rounds import ensure

                result = ensure(deps, EnsureRequest(entry=ENTRY, wait=False))
            return 200, {
                "ok": result.exit_code == 0,
                "decision": result.decision,
                "message": "\n".join(ensure_text(result)),
            }
        finally:
            deps.close()

    def _record_only(self, service: str) -> Config | None:
        """A config naming only ``service``, with the launcher its record's handle names:
        enough to stop the server it records, never to start one (no command)."""
        from gpuctl.adapters.store.direct import DirectStore
        from gpuctl.wiring.build import LOCAL_HOST

        try:
            rec = DirectStore(self.state_dir).get(service)
        except GpuctlError:
            return None
        kind = (rec.handle or {}).get("kind")
        if not isinstance(kind, str):
            return None
        host = self._here(HostConfig(name=LOCAL_HOST))
        svc = ServiceConfig(name=service, host=LOCAL_HOST, launcher=kind)
        return replace(self.config, hosts={LOCAL_HOST: host}, services={service: svc})
