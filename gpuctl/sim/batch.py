"""A simulated batch job (a VLM captioning a folder of photos): resumable, checkpointed.

``python -m gpuctl.sim.batch --name photos --memory 30GiB --items DIR --port P``
claims its memory on the simulated GPU, answers ``GET /health`` (200 once loaded), and
works through the files of ``DIR`` in name order, one at a time. Each item done is
checkpointed (``DIR/.done/<item>``, written atomically) and logged as a line
``done <item>`` in ``DIR/.done.log`` only after its checkpoint: a SIGTERM (preemption)
abandons the item in progress, which is not logged and is done again after a restart.
So the log has each item at most once, and after enough runs every item once: the
scenario test counts exactly that. It exits 0 when every item is done, giving its memory
back (a started batch with nothing left to do exits at once).

Standard library and ``gpuctl.sim`` only.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from gpuctl.core.units import parse_duration_s, parse_size_mib
from gpuctl.sim.errors import SimError, SimOutOfMemory
from gpuctl.sim.gpu import SimGpu
from gpuctl.sim.signals import stop_on_signals


def pending(items: Path) -> list[str]:
    done = items / ".done"
    return sorted(
        p.name
        for p in items.iterdir()
        if p.is_file() and not p.name.startswith(".") and not (done / p.name).exists()
    )


def run_batch(
    sim: SimGpu, name: str, memory_mib: int, *, items: Path, port: int, per_item_s: float
) -> int:
    ready = threading.Event()

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/health":
                self.send_response(404)
            else:
                self.send_response(200 if ready.is_set() else 503)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            return

    (items / ".done").mkdir(exist_ok=True)
    server = ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with stop_on_signals() as stop, sim.claim(name, 0) as claim:
            try:
                claim.set(memory_mib)
            except SimOutOfMemory as err:
                print(f"torch.OutOfMemoryError: {err.message}", file=sys.stderr, flush=True)
                return 1
            ready.set()
            todo = pending(items)
            print(f"INFO batch {name}: {len(todo)} items to do", flush=True)
            for item in todo:
                stop.sleep(per_item_s, step=0.02)
                if stop.signal is not None:
                    print(f"INFO batch {name}: stopped before finishing {item}", flush=True)
                    return 0
                mark = items / ".done" / item
                tmp = mark.with_name(f".{item}.tmp")
                tmp.write_text("done\n")
                os.replace(tmp, mark)
                with (items / ".done.log").open("a") as log:
                    log.write(f"done {item}\n")
            # Done: it exits, and leaving the claim gives its memory back, as a real
            # batch process's does when it exits (it held it until stopped).
            print(f"INFO batch {name}: all items done; exiting", flush=True)
    finally:
        server.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuctl.sim.batch", description=__doc__)
    parser.add_argument("--name", required=True)
    parser.add_argument("--memory", required=True)
    parser.add_argument("--items", required=True, help="the folder of items")
    parser.add_argument("--port", type=int, required=True, help="its /health port")
    parser.add_argument("--per-item", default="200ms", help="time per item")
    parser.add_argument("--sim-dir", help="simulated GPU directory (default $GPUCTL_SIM_DIR)")
    args = parser.parse_args(argv)
    try:
        return run_batch(
            SimGpu(args.sim_dir),
            args.name,
            parse_size_mib(args.memory),
            items=Path(args.items),
            port=args.port,
            per_item_s=parse_duration_s(args.per_item),
        )
    except (SimError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
