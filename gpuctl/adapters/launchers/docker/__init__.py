"""The ``docker`` launcher: one container per service, through the Docker Engine API.

The container is named ``gpuctl-<service>`` and labelled so that ``docker ps`` tells ours
from the rest, and so that a changed configuration is noticed::

    docker ps -a --filter label=gpuctl.managed=true \\
        --format '{{.Names}} {{.Status}} {{.Label "gpuctl.config-hash"}}'

``start`` is the equivalent of (gpuctl never pulls: the image must be on that host)::

    docker create --name gpuctl-vllm --label gpuctl.managed=true ... --gpus all \\
        --init --restart no IMAGE COMMAND && docker start gpuctl-vllm

A stopped container whose launch configuration is unchanged is started again (its
file system, e.g. a compile cache, survives); a changed one is removed and recreated.

One idea per module: ``spec`` builds what ``containers.create`` gets (pure, no engine),
``errors`` turns library exceptions into gpuctl's, ``pids`` finds the server's host pid
behind Docker's init, and ``launcher`` is the lifecycle. ``docker`` itself is imported
lazily (it costs 120-360 ms of start-up that no other command should pay).
"""

from gpuctl.adapters.launchers.docker.launcher import DEFAULT_URL, DockerLauncher
from gpuctl.adapters.launchers.docker.spec import (
    LABEL_HASH,
    LABEL_MANAGED,
    LABEL_SERVICE,
    config_hash,
    container_name,
)

__all__ = [
    "DEFAULT_URL",
    "LABEL_HASH",
    "LABEL_MANAGED",
    "LABEL_SERVICE",
    "DockerLauncher",
    "config_hash",
    "container_name",
]
