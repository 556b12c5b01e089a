"""The docker launcher against a real Docker Engine (scripts/ensure-dockerd starts one).

The containers run this checkout's gpuctl from read-only host mounts in a locally
imported image (tests/docker_helpers.py), on the host's network and PID namespace.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import httpx
import psutil
import pytest
import requests

from gpuctl.adapters.launchers.base import Handle
from gpuctl.adapters.launchers.docker import (
    LABEL_HASH,
    LABEL_MANAGED,
    LABEL_SERVICE,
    DockerLauncher,
    config_hash,
    container_name,
)
from gpuctl.config import ServiceConfig
from gpuctl.errors import LauncherError, StartFailed
from gpuctl.sim.host import free_port
from tests.docker_helpers import (
    docker_client,
    docker_unavailable,
    ensure_test_image,
    model_server_command,
    python_command,
    remove_service_containers,
    sim_service,
    unique_name,
    wait_for,
)

pytestmark = pytest.mark.docker

SLEEPER = python_command("-c", "import time; time.sleep(600)")


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)
    c = docker_client(timeout=60.0)
    ensure_test_image(c)
    yield c
    c.close()


@pytest.fixture
def launcher(client: Any) -> Iterator[DockerLauncher]:
    launcher = DockerLauncher(None, timeout_s=30.0)
    yield launcher
    launcher.close()


@pytest.fixture
def make_service(client: Any, tmp_path: Path) -> Iterator[Callable[..., ServiceConfig]]:
    """``make_service(command, **kw)``: a fresh service name; its containers go at teardown."""
    names: list[str] = []
    sim_dir = tmp_path / "sim"
    sim_dir.mkdir()

    def make(command: str = SLEEPER, name: str | None = None, **kw: Any) -> ServiceConfig:
        name = name or unique_name()
        names.append(name)
        return sim_service(name, command, sim_dir=sim_dir, **kw)

    try:
        yield make
    finally:
        remove_service_containers(client, names)


def containers_of(client: Any, service: ServiceConfig) -> list[Any]:
    return list(
        client.containers.list(all=True, filters={"label": f"{LABEL_SERVICE}={service.name}"})
    )


def status_of(client: Any, container_id: str) -> str:
    return str(client.containers.get(container_id).status)


def claims(sim_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted((sim_dir / "claims").glob("*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # replaced between listing and reading
    return out


def health(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code
    except httpx.TransportError:
        return None


# --------------------------------------------------------------------------- real server


def test_start_serves_and_claims_with_host_pid(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    port = free_port()
    svc = make_service(model_server_command(port))
    sim_dir = Path(svc.env["GPUCTL_SIM_DIR"])

    handle = launcher.start(svc)

    assert handle.kind == "docker"
    assert handle.container_name == container_name(svc) == f"gpuctl-{svc.name}"
    ct = client.containers.get(handle.container_id)
    assert ct.status == "running"
    assert ct.labels[LABEL_MANAGED] == "true"
    assert ct.labels[LABEL_SERVICE] == svc.name
    assert ct.labels[LABEL_HASH] == config_hash(svc)
    # The server process itself, as the host sees it (a host PID namespace has no init).
    assert handle.pid == ct.attrs["State"]["Pid"]
    server = psutil.Process(handle.pid)
    assert "model-server" in server.cmdline()
    assert handle.pid_start == server.create_time()
    assert launcher.alive(handle) is True

    # Refuses while loading (2 s), then serves; the container's python starts in ~1 s.
    ready = wait_for(lambda: health(port) == 200, timeout_s=20.0, step_s=0.2)
    assert ready, launcher.log_tail(handle)
    mine = [c for c in claims(sim_dir) if c["pid"] == handle.pid]
    assert mine and mine[0]["memory_mib"] == 20 * 1024, claims(sim_dir)
    assert "Application startup complete" in launcher.log_tail(handle, lines=50)

    found = launcher.find(svc)
    assert found is not None and found.container_id == handle.container_id

    launcher.stop(handle, grace_s=10)
    assert status_of(client, handle.container_id) == "exited"
    assert launcher.alive(handle) is False
    assert launcher.find(svc) is None
    # SIGTERM reached the server through docker-init: it released its memory cleanly.
    assert client.containers.get(handle.container_id).attrs["State"]["ExitCode"] == 0
    assert not [c for c in claims(sim_dir) if c["pid"] == handle.pid]


# --------------------------------------------------------------------------- reuse


def test_pid_is_the_server_behind_docker_init(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    svc = make_service(pid_mode=None)  # a private PID namespace: docker-init is PID 1
    handle = launcher.start(svc)
    init_pid = client.containers.get(handle.container_id).attrs["State"]["Pid"]
    assert psutil.Process(init_pid).name() in ("docker-init", "tini")
    assert handle.pid != init_pid
    server = psutil.Process(handle.pid)
    assert server.ppid() == init_pid
    # docker-init forks, then execs the command: until the exec the child still shows
    # docker-init's own command line under the same pid.
    deadline = time.monotonic() + 10
    while Path(server.cmdline()[0]).name in ("docker-init", "tini") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.cmdline()[1:] == ["-c", "import time; time.sleep(600)"]
    # docker-init passes the stop signal on: a quick, clean stop (python dies of SIGTERM).
    launcher.stop(handle, grace_s=10)
    state = client.containers.get(handle.container_id).attrs["State"]
    assert state["ExitCode"] == 143


def test_start_twice_returns_the_running_container(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    svc = make_service()
    first = launcher.start(svc)
    second = launcher.start(svc)
    assert second.container_id == first.container_id
    assert second.pid == first.pid
    assert [c.id for c in containers_of(client, svc)] == [first.container_id]


def test_start_after_stop_reuses_the_container(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    svc = make_service()
    first = launcher.start(svc)
    launcher.stop(first, grace_s=5)
    assert launcher.alive(first) is False

    again = launcher.start(svc)
    assert again.container_id == first.container_id
    assert again.pid and again.pid != first.pid
    assert status_of(client, again.container_id) == "running"
    assert launcher.alive(again) is True


def test_changed_config_recreates_the_container(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    svc = make_service()
    first = launcher.start(svc)
    launcher.stop(first, grace_s=5)

    changed = make_service(name=svc.name, env={"EXTRA": "1"})
    assert config_hash(changed) != config_hash(svc)
    second = launcher.start(changed)

    assert second.container_id != first.container_id
    assert [c.id for c in containers_of(client, svc)] == [second.container_id]
    ct = client.containers.get(second.container_id)
    assert ct.labels[LABEL_HASH] == config_hash(changed)
    assert "EXTRA=1" in ct.attrs["Config"]["Env"]
    # The old handle names a container that is gone: dead, not "cannot tell".
    assert launcher.alive(first) is False


def test_created_leftover_is_replaced(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    svc = make_service()
    kwargs = launcher.inspect_config(svc)
    image, command = kwargs.pop("image"), kwargs.pop("command")
    leftover = client.containers.create(image, command, **kwargs)  # never started
    assert leftover.status == "created"

    handle = launcher.start(svc)
    assert handle.container_id != leftover.id
    assert [c.id for c in containers_of(client, svc)] == [handle.container_id]
    assert status_of(client, handle.container_id) == "running"


def test_foreign_container_with_our_name_is_left_alone(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    svc = make_service()
    kwargs = launcher.inspect_config(svc)
    # Same name, but not ours; the service label only lets the fixture clean it up.
    foreign = client.containers.create(
        kwargs["image"], kwargs["command"], name=kwargs["name"], labels={LABEL_SERVICE: svc.name}
    )
    with pytest.raises(StartFailed, match="gpuctl did not create") as info:
        launcher.start(svc)
    assert "docker rm -f" in info.value.hint
    assert client.containers.get(foreign.id).status == "created"
    assert launcher.find(svc) is None


# --------------------------------------------------------------------------- failures


def test_crashing_command_is_dead_with_its_log(
    launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    svc = make_service(python_command("-c", "import sys; print('boom'); sys.exit(3)"))
    handle = launcher.start(svc)
    assert wait_for(lambda: launcher.alive(handle) is False, timeout_s=15.0)
    assert "boom" in launcher.log_tail(handle)
    assert launcher.find(svc) is None


def test_gpu_request_without_nvidia_runtime(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    if "nvidia" in (client.info().get("Runtimes") or {}):
        pytest.skip("this Docker Engine has the NVIDIA runtime")
    svc = make_service(gpus=True)
    for _ in range(2):  # the second try must not trip over a leftover (409 name conflict)
        with pytest.raises(StartFailed) as info:
            launcher.start(svc)
        assert "has no NVIDIA runtime" in info.value.message
        assert "nvidia-container-toolkit" in info.value.hint
        assert f"services.{svc.name}.gpus = false" in info.value.hint
        assert containers_of(client, svc) == []


def test_missing_image_is_not_pulled(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    svc = make_service(image="gpuctl-test-missing:nope")
    with pytest.raises(StartFailed, match="gpuctl-test-missing:nope") as info:
        launcher.start(svc)
    assert info.value.hint == (
        "docker pull gpuctl-test-missing:nope on that host (gpuctl does not pull)"
    )
    assert containers_of(client, svc) == []


# --------------------------------------------------------------------------- configuration


def test_port_mapping_at_the_configuration_level(
    client: Any, launcher: DockerLauncher, make_service: Callable[..., ServiceConfig]
) -> None:
    svc = make_service(ports={"8000": 8000, "9000/udp": 9001}, network=None, pid_mode=None)
    kwargs = launcher.inspect_config(svc)
    assert kwargs["ports"] == {"8000/tcp": 8000, "9000/udp": 9001}
    assert "network_mode" not in kwargs
    assert "device_requests" not in kwargs
    assert kwargs["init"] is True
    assert kwargs["restart_policy"] == {"Name": "no"}
    assert kwargs["command"][1:] == ["-c", "import time; time.sleep(600)"]

    # What the engine stores for it (created, never started: no bridge needed).
    image, command = kwargs.pop("image"), kwargs.pop("command")
    ct = client.containers.create(image, command, **kwargs)
    bindings = ct.attrs["HostConfig"]["PortBindings"]
    assert bindings["8000/tcp"] == [{"HostIp": "", "HostPort": "8000"}]
    assert bindings["9000/udp"] == [{"HostIp": "", "HostPort": "9001"}]


def test_gpu_and_sizes_at_the_configuration_level(launcher: DockerLauncher) -> None:
    svc = ServiceConfig(
        name="vllm",
        host="dgx",
        image="vllm/vllm-openai:latest",
        command="vllm serve Qwen/Qwen3-32B --port 8000",
        ipc_mode="host",
        shm_size="2g",
        network="host",
        volumes=("/data/hf:/root/.cache/huggingface:ro", "hf-cache:/cache"),
    )
    kwargs = launcher.inspect_config(svc)
    assert kwargs["name"] == "gpuctl-vllm"
    assert kwargs["command"] == ["vllm", "serve", "Qwen/Qwen3-32B", "--port", "8000"]
    assert kwargs["device_requests"] == [
        {"Driver": "", "Count": -1, "DeviceIDs": [], "Capabilities": [["gpu"]], "Options": {}}
    ]
    assert kwargs["ipc_mode"] == "host"
    assert kwargs["shm_size"] == 2 * 1024**3
    assert kwargs["network_mode"] == "host"
    assert kwargs["volumes"] == list(svc.volumes)
    assert kwargs["labels"][LABEL_HASH] == config_hash(svc)


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("volumes", ("/only-one-part",), "volumes"),
        ("ports", {"http": 8000}, "ports"),
        ("shm_size", "lots", "shm_size"),
    ],
)
def test_bad_launch_config_names_its_key(
    launcher: DockerLauncher, field: str, value: object, where: str
) -> None:
    svc = ServiceConfig(name="vllm", host="dgx", image="img", **{field: value})  # type: ignore[arg-type]
    with pytest.raises(StartFailed, match=rf"^services\.vllm\.{where}:"):
        launcher.inspect_config(svc)


def test_config_hash_ignores_what_does_not_shape_the_container() -> None:
    base = ServiceConfig(name="vllm", host="dgx", image="img", env={"A": "1", "B": "2"})
    same = ServiceConfig(
        name="vllm", host="dgx", image="img", env={"B": "2", "A": "1"}, priority=1,
        idle_timeout_s=5, health_timeout_s=5, stop_timeout_s=1, match=("x",),
    )  # fmt: skip
    assert config_hash(same) == config_hash(base)
    assert config_hash(ServiceConfig(name="vllm", host="dgx", image="img2")) != config_hash(base)


# --------------------------------------------------------------------------- connecting


def test_unreachable_engine(make_service: Callable[..., ServiceConfig]) -> None:
    launcher = DockerLauncher("unix:///nonexistent.sock", timeout_s=5)
    svc = make_service()
    with pytest.raises(LauncherError, match="is dockerd running") as info:
        launcher.start(svc)
    assert "unix:///nonexistent.sock" in info.value.message
    assert not isinstance(info.value, StartFailed)
    handle = Handle(kind="docker", container_name=container_name(svc))
    assert launcher.alive(handle) is None
    with pytest.raises(LauncherError, match="is dockerd running"):
        launcher.stop(handle, grace_s=1)


def test_ssh_without_paramiko(make_service: Callable[..., ServiceConfig]) -> None:
    if importlib.util.find_spec("paramiko") is not None:
        pytest.skip("paramiko is installed")
    launcher = DockerLauncher("ssh://me@127.0.0.1", timeout_s=5)
    with pytest.raises(LauncherError, match="needs paramiko") as info:
        launcher.find(make_service())
    assert info.value.hint == "pip install 'gpuctl[ssh]'"


def test_stop_and_logs_of_a_missing_container(launcher: DockerLauncher) -> None:
    gone = Handle(kind="docker", container_id="0" * 64, container_name="gpuctl-gone-xyz")
    launcher.stop(gone, grace_s=1)  # idempotent: nothing to stop
    assert launcher.alive(gone) is False
    assert launcher.log_tail(gone) == ""


def _api_error(status: int, explanation: str) -> Exception:
    response = requests.Response()
    response.status_code = status
    return docker.errors.APIError("error", response=response, explanation=explanation)


def _engine_errors() -> list[tuple[str, Callable[[], BaseException], str, str]]:
    ssh_exception = type("SSHException", (Exception,), {"__module__": "paramiko.ssh_exception"})
    return [
        (
            "unix:///run/docker.sock",
            lambda: docker.errors.DockerException(
                "Error while fetching server API version: ('Connection aborted.', "
                "PermissionError(13, 'Permission denied'))"
            ),
            "permission denied on the Docker Engine socket /run/docker.sock",
            "add yourself to the docker group",
        ),
        (
            "tcp://10.0.0.9:2375",
            lambda: docker.errors.DockerException(
                "Error while fetching server API version: HTTPConnectionPool(host='10.0.0.9', "
                "port=2375): Max retries exceeded (Caused by NewConnectionError('Failed to "
                "establish a new connection: [Errno 111] Connection refused'))"
            ),
            "cannot reach the Docker Engine at tcp://10.0.0.9:2375: is dockerd running?",
            "DOCKER_HOST",
        ),
        (
            "ssh://me@10.0.0.9:2222",
            lambda: ssh_exception("Server '[10.0.0.9]:2222' not found in known_hosts"),
            "the ssh host key of 10.0.0.9 is unknown",
            "ssh-keyscan -p 2222 10.0.0.9 >> ~/.ssh/known_hosts",
        ),
        (
            "tcp://10.0.0.9:2376",
            lambda: docker.errors.TLSParameterError(
                "Path to a certificate and key files must be provided through the client_config"
            ),
            "bad TLS settings for the Docker Engine at tcp://10.0.0.9:2376",
            "DOCKER_CERT_PATH",
        ),
        (
            "unix:///run/docker.sock",
            lambda: requests.exceptions.ReadTimeout("Read timed out. (read timeout=5)"),
            "did not answer within 5 s",
            "overloaded",
        ),
        (
            "unix:///run/docker.sock",
            lambda: _api_error(500, "client version 1.99 is too new"),
            "answered 500: client version 1.99 is too new",
            "engine's log",
        ),
    ]


@pytest.mark.parametrize(("url", "make_error", "message", "hint"), _engine_errors())
def test_engine_errors_become_one_line_with_a_hint(
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    make_error: Callable[[], BaseException],
    message: str,
    hint: str,
) -> None:
    def refuse(**_: Any) -> Any:
        raise make_error()

    monkeypatch.setattr(docker, "from_env", refuse)
    # These are docker-py's errors: skip the launcher's own socket check before it.
    monkeypatch.setattr(DockerLauncher, "_check_unix_socket", lambda self: None)
    launcher = DockerLauncher(url, timeout_s=5)
    svc = ServiceConfig(name="vllm", host="dgx", image="img")
    with pytest.raises(LauncherError) as info:
        launcher.find(svc)
    assert message in info.value.message
    assert "\n" not in info.value.message
    assert hint in info.value.hint
    assert launcher.alive(Handle(kind="docker", container_name="gpuctl-vllm")) is None


def test_the_container_gets_the_nonce_and_no_secrets(
    client: Any, make_service: Callable[..., ServiceConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start nonce is in the server's environment on the host (/proc/<pid>/environ,
    where the agent looks for it); gpuctl's secrets are not, unless ``env`` sets them."""
    from gpuctl.adapters import procinfo
    from gpuctl.adapters.launchers.environ import START_NONCE_ENV, secret_names
    from gpuctl.config import HostConfig

    monkeypatch.setenv("GPUCTL_AGENT_TOKEN", "agent-secret")
    monkeypatch.setenv("DGX_TOKEN", "host-secret")
    host = HostConfig(name="dgx", token_env="DGX_TOKEN")
    launcher = DockerLauncher(None, timeout_s=30.0, secrets=secret_names(host))
    try:
        svc = make_service(env={"KEEP": "1", "DGX_TOKEN": "given"})
        # Unique per run: other runs of this suite may share the machine.
        nonce = secrets.token_hex(8)
        handle = launcher.start(svc, start_nonce=nonce)
        env = client.containers.get(handle.container_id).attrs["Config"]["Env"]
        assert f"{START_NONCE_ENV}={nonce}" in env
        assert "KEEP=1" in env
        assert "DGX_TOKEN=given" in env
        assert not any(e.startswith("GPUCTL_AGENT_TOKEN=") for e in env)
        # The nonce tells the server's host pid, as the agent will look for it.
        assert handle.pid is not None
        # The container's process shows its environment once runc has exec'd it, which
        # a loaded machine may not have done yet when the engine has answered.
        deadline = time.monotonic() + 30
        while handle.pid not in (found := procinfo.pids_with_env(START_NONCE_ENV, nonce)):
            assert time.monotonic() < deadline, (handle.pid, found)
            time.sleep(0.1)
        assert launcher.find(svc, nonce) == launcher.find(svc)
        assert launcher.find(svc) is not None
    finally:
        launcher.close()
