"""The ``jupyter`` launcher: a server started from a named JupyterLab terminal.

For a GPU host where JupyterLab is the way in (no Docker, no ssh). Everything goes
through the Jupyter server's REST API and one terminal websocket; nothing runs here.

What ``start`` does, as a user would by hand::

    PUT  /api/contents/gpuctl-jupyter          {"type": "directory"}
    PUT  /api/contents/gpuctl-jupyter/launch_vllm.sh  cd, exports, ``exec <command>``
    GET  /api/terminals/gpuctl_vllm            (POST /api/terminals only on 404)
    ws   /terminals/websocket/gpuctl_vllm, typed:
         cd "$JUPYTER_SERVER_ROOT"; nohup bash gpuctl-jupyter/launch_vllm.sh >/dev/null 2>&1 \\
             </dev/null & echo PID=$!; disown

Why it is built this way (each verified against a real jupyter_server in
``tests/test_launcher_jupyter.py``):

- ``nohup … </dev/null & …; disown`` is the one form that survives closing the websocket,
  deleting the terminal and restarting (even ``kill -9``) the Jupyter server. The launched
  job is its own process group (the terminal's shell has job control), and the script
  ends in ``exec``, so ``$!`` is the server's own pid and the group is the server's.
- The script goes through the Contents API because the pty silently drops a long typed
  line; what we type stays a few hundred characters whatever the command and env hold.
- Every marker we wait for is ``GPUCTL_<nonce>_$((0+1))_KEY=``: the echo of the typed
  line shows ``$((0+1))`` and only the output shows ``1``; the per-call nonce ignores the
  old output Jupyter replays to each new websocket.
- Paths are relative to Jupyter's ``root_dir``, which is not the terminal's working
  directory (that is the Jupyter process's own). Terminals get ``$JUPYTER_SERVER_ROOT``;
  we ``cd`` there before anything relative, and learn the absolute root from ``$PWD``.
- ``POST /api/terminals`` with a name that exists orphans the old shell, so we GET first.
- Liveness reads ``/proc/PID/stat`` (state after the last ``)``, since the command name may
  hold spaces, and the start time): a zombie is dead, and a pid whose start time differs
  from the recorded one is somebody else's (never signalled).
- The terminal's shell has the Jupyter server's environment, not ours: the script
  ``unset``s gpuctl's secrets (the agent token, the host's token variables, the Jupyter
  token) before it exports the service's ``env`` and the start nonce.

The terminal's shell (Jupyter's ``$SHELL``) must speak POSIX sh: bash, zsh, dash. For
fish, start Jupyter with ``SHELL=/bin/bash``.

One idea per module: ``script`` writes the launch script and the paths (pure),
``terminal`` speaks the terminal websocket, ``rest`` the REST API with its error
mapping, and ``launcher`` is the lifecycle.

Errors (``LauncherError``; ``StartFailed`` from ``start`` once Jupyter answered):
unreachable (``JupyterUnreachable``; ``alive`` answers None instead), token refused,
Host header refused (``allow_remote_access``), no terminals extension, no answer from
the terminal in time.
"""

from gpuctl.adapters.launchers.jupyter.launcher import JupyterLauncher
from gpuctl.adapters.launchers.jupyter.rest import JupyterUnreachable
from gpuctl.adapters.launchers.jupyter.script import (
    SCRIPT_DIR,
    exec_line,
    launch_script,
    log_path,
    script_path,
    terminal_name,
)

__all__ = [
    "SCRIPT_DIR",
    "JupyterLauncher",
    "JupyterUnreachable",
    "exec_line",
    "launch_script",
    "log_path",
    "script_path",
    "terminal_name",
]
