"""The loopback API's kubelet: runs each pod's containers as local subprocesses.

One thread per pod walks it through what a kubelet reports: scheduled (``PodScheduled``), the
containers' configuration resolved (environment from literal values, Secrets and the downward
API), started (``Running``, ``Ready``), and terminated (``Succeeded`` or ``Failed``, each
container's exit code, reason and termination message). :meth:`Kubelet.terminate` stops a pod
the way a kubelet does on deletion, eviction or node shutdown: SIGTERM to each container's main
process, the grace period, then SIGKILL to the whole container (its process group).

The image is ignored: the command runs on this machine, with ``python3``/``python`` resolving to
the interpreter running the tests. A kubelet gives each pod its own UTS namespace whose hostname
is the pod's ``spec.hostname`` or else its name (cut to 63 characters); here a Python container
gets the same answer from ``socket.gethostname()`` through a ``sitecustomize`` on its
``PYTHONPATH`` (:data:`POD_HOSTNAME`), so that anything naming itself after its host (a worker
before ``ADB_POD_NAME``: ``<hostname>:<pid>``) does so as in a real pod. A pod with
``hostNetwork: true`` shares the node's UTS namespace: its containers get no ``sitecustomize`` and
see this host's hostname (``$HOSTNAME`` too), as a host-network pod sees its node's. The downward
API (``valueFrom.fieldRef``: ``metadata.name`` and the rest) reaches every pod's environment alike.
Everything is guarded by the API server's one lock, and every change notifies its one condition
variable, which the tests and the log streams wait on.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.k8s.server import LoopbackKubernetes

#: the termination message a kubelet keeps at most (bytes)
MAX_TERMINATION_MESSAGE = 4096
#: FallbackToLogsOnError: the last lines / bytes of the log used as the message
FALLBACK_LOG_LINES, FALLBACK_LOG_BYTES = 80, 2048
NODE_SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
#: what a container's Python answers for ``socket.gethostname()``: its pod's hostname, as in the
#: pod's own UTS namespace (the kubelet's ``GeneratePodHostNameAndDomain``: ``spec.hostname`` or the
#: name, cut to 63 characters, no trailing ``-`` or ``.``), from ``HOSTNAME`` (the uncut name); a
#: ``hostNetwork`` pod gets none of it (the node's UTS namespace: this host's hostname)
POD_HOSTNAME = '''"""The loopback kubelet's stand-in for a pod's UTS namespace (tests/k8s/kubelet.py)."""
import os
import socket

_name = os.environ.get("HOSTNAME")
if _name:
    _hostname = _name[:63].rstrip("-.")
    socket.gethostname = lambda: _hostname
'''


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def rfc3339(moment: dt.datetime) -> str:
    """The API's timestamp format (second precision, as metav1.Time serializes)."""
    return moment.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_nano(moment: dt.datetime) -> str:
    """The format of a log line's timestamp (``timestamps=true``)."""
    return moment.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


class ContainerConfigError(Exception):
    """What a kubelet reports as ``CreateContainerConfigError`` (the container waits)."""


@dataclass
class LogLine:
    at: dt.datetime
    data: bytes  # with its trailing newline, unless the output ended without one


@dataclass
class ContainerRuntime:
    name: str
    spec: dict[str, Any]
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None
    log: list[LogLine] = field(default_factory=list)
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    terminated: bool = False  # set after the exit and the last log line are recorded

    @property
    def termination_log(self) -> Path:
        return self.directory / "termination-log"


@dataclass
class PodRuntime:
    namespace: str
    name: str
    uid: str
    directory: Path
    containers: list[ContainerRuntime]
    thread: threading.Thread | None = None
    stopping: bool = False  # deletion or eviction under way: start nothing more
    stopper: threading.Thread | None = None
    final_reason: str | None = None  # pod status.reason once it ends (e.g. "Terminated")
    final_message: str | None = None
    finished: bool = False
    remove_when_finished: bool = False  # a graceful deletion: the object goes once the pod stops
    node_selector: dict[str, str] = field(default_factory=dict)
    scheduled: bool = False  # holds a slot of every limited node label it selects until it ends

    def container(self, name: str) -> ContainerRuntime | None:
        return next((c for c in self.containers if c.name == name), None)


_VAR_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(value: str, variables: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (``$$`` escapes; unknown references stay as written)."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return variables.get(match.group(1), match.group(0))

    return _VAR_REF.sub(replace, value)


class Kubelet:
    """Runs pods for one :class:`LoopbackKubernetes` (which owns the lock, the objects and this)."""

    def __init__(
        self,
        api: LoopbackKubernetes,
        root: Path,
        *,
        node_name: str,
        image_env: Mapping[str, str],
        termination_message_env: str | None,
    ) -> None:
        self.api = api
        self.root = root
        self.node_name = node_name
        self.image_env = dict(image_env)
        self.termination_message_env = termination_message_env
        self.bin_dir = root / "bin"
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        for name in ("python3", "python"):
            wrapper = self.bin_dir / name
            wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
            wrapper.chmod(0o755)
        self.uts_dir = root / "uts"
        self.uts_dir.mkdir(parents=True, exist_ok=True)
        (self.uts_dir / "sitecustomize.py").write_text(POD_HOSTNAME)
        self.pods: dict[str, PodRuntime] = {}  # by pod UID (a name can come back as a new pod)

    # ------------------------------------------------------------------ lifecycle (API calls)

    def admit(self, pod: dict[str, Any]) -> None:
        """Start running a pod the API server just stored (called under the lock)."""
        meta = pod["metadata"]
        directory = self.root / "pods" / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}"
        containers = []
        for spec in pod["spec"]["containers"]:
            where = directory / spec["name"]
            where.mkdir(parents=True, exist_ok=True)
            containers.append(ContainerRuntime(spec["name"], spec, where))
        runtime = PodRuntime(meta["namespace"], meta["name"], meta["uid"], directory, containers)
        runtime.node_selector = dict(pod["spec"].get("nodeSelector") or {})
        self.pods[meta["uid"]] = runtime
        runtime.thread = threading.Thread(
            target=self._run, args=(runtime,), name=f"kubelet-{meta['name']}", daemon=True
        )
        runtime.thread.start()

    def terminate(
        self,
        runtime: PodRuntime,
        grace_s: float,
        *,
        final_reason: str | None = None,
        final_message: str | None = None,
        remove: bool = False,
    ) -> None:
        """Stop a pod: SIGTERM, ``grace_s``, SIGKILL (called under the lock; returns at once)."""
        runtime.remove_when_finished = runtime.remove_when_finished or remove
        if runtime.stopping:
            return
        runtime.stopping = True
        runtime.final_reason, runtime.final_message = final_reason, final_message
        running = [c for c in runtime.containers if c.process is not None and not c.terminated]
        for container in running:
            self.api.record_event(
                runtime.namespace,
                runtime.name,
                runtime.uid,
                "Normal",
                "Killing",
                f"Stopping container {container.name}",
                container=container.name,
            )
        runtime.stopper = threading.Thread(
            target=self._stop, args=(running, grace_s), name=f"kill-{runtime.name}", daemon=True
        )
        runtime.stopper.start()
        self.api.changed.notify_all()

    def shutdown(self) -> None:
        """Kill every container now and wait for the pod threads (the server is closing)."""
        with self.api.lock:
            runtimes = list(self.pods.values())
            for runtime in runtimes:
                runtime.stopping = True
            self.api.changed.notify_all()
        for runtime in runtimes:
            for container in runtime.containers:
                if container.process is not None:
                    _kill_group(container.process, signal.SIGKILL)
        for runtime in runtimes:
            for thread in (runtime.thread, runtime.stopper):
                if thread is not None:
                    thread.join(timeout=30)

    # ------------------------------------------------------------------------- the pod thread

    def _run(self, runtime: PodRuntime) -> None:
        try:
            self._run_pod(runtime)
        finally:
            with self.api.lock:
                key = (runtime.namespace, runtime.name, runtime.uid)
                pod = self.api.pod_object(key)
                if pod is not None and pod["status"].get("phase") not in ("Succeeded", "Failed"):
                    self.api.mutate_pod(key, lambda p: self._status_final(p, runtime))
                runtime.finished = True
                self.api.pod_finished(runtime)

    def _run_pod(self, runtime: PodRuntime) -> None:
        key = (runtime.namespace, runtime.name, runtime.uid)
        with self.api.lock:
            if not self._wait_for_capacity(runtime):
                return
            runtime.scheduled = True
            self.api.mutate_pod(key, self._schedule)
            self.api.record_event(
                runtime.namespace,
                runtime.name,
                runtime.uid,
                "Normal",
                "Scheduled",
                f"Successfully assigned {runtime.namespace}/{runtime.name} to {self.node_name}",
                source="default-scheduler",
            )
            # the containers' configuration: wait (as a kubelet retries) until every Secret exists
            while True:
                if runtime.stopping:
                    return
                pod = self.api.pod_object(key)
                if pod is None:
                    return
                try:
                    launches = [self._launch_spec(pod, c) for c in runtime.containers]
                    break
                except ContainerConfigError as exc:
                    message = str(exc)

                    def wait_config(pod: dict[str, Any], message: str = message) -> None:
                        _waiting(pod, "CreateContainerConfigError", message)

                    self.api.mutate_pod(key, wait_config)
                    self.api.record_event(
                        runtime.namespace,
                        runtime.name,
                        runtime.uid,
                        "Warning",
                        "Failed",
                        f"Error: {message}",
                    )
                    self.api.changed.wait()
            for container, (argv, env, cwd) in zip(runtime.containers, launches, strict=True):
                self._start(runtime, container, argv, env, cwd)
            self.api.mutate_pod(key, lambda p: self._status_running(p, runtime))
        for container in runtime.containers:
            if container.process is not None:
                container.process.wait()
                _kill_group(container.process, signal.SIGKILL)  # the container's cgroup goes with it
                if container.reader is not None:
                    container.reader.join()
            with self.api.lock:
                container.finished_at = container.finished_at or now()
                container.terminated = True
                self.api.mutate_pod(key, functools.partial(self._status_terminated, container=container))
                if all(c.terminated for c in runtime.containers):  # the phase moves with the last exit
                    self.api.mutate_pod(key, lambda p: self._status_final(p, runtime))

    def _full_labels(self, runtime: PodRuntime) -> list[str]:
        """The limited node labels this pod selects that have no free slot (called under the lock)."""
        full = []
        for label, slots in self.api.capacity.items():
            key, value = label
            if runtime.node_selector.get(key) != value:
                continue
            used = sum(
                1
                for other in self.pods.values()
                if other.scheduled and not other.finished and other.node_selector.get(key) == value
            )
            if used >= slots:
                full.append(f"{key}={value}")
        return full

    def _wait_for_capacity(self, runtime: PodRuntime) -> bool:
        """Keep the pod ``Pending`` (``Unschedulable``) while a node label it selects is full.

        Returns False when the pod was deleted or evicted meanwhile (called under the lock).
        """
        key = (runtime.namespace, runtime.name, runtime.uid)
        reported = False
        while not runtime.stopping and self.api.pod_object(key) is not None:
            full = self._full_labels(runtime)
            if not full:
                return True
            if not reported:
                message = f"0/1 nodes are available: no free node with {', '.join(full)}."

                def unschedulable(pod: dict[str, Any], message: str = message) -> None:
                    set_condition(pod["status"], "PodScheduled", "False", "Unschedulable", message)

                self.api.mutate_pod(key, unschedulable)
                self.api.record_event(
                    runtime.namespace,
                    runtime.name,
                    runtime.uid,
                    "Warning",
                    "FailedScheduling",
                    message,
                    source="default-scheduler",
                )
                reported = True
            self.api.changed.wait()
        return False

    def _schedule(self, pod: dict[str, Any]) -> None:
        pod["spec"]["nodeName"] = self.node_name
        status = pod["status"]
        status.update(hostIP="127.0.0.1", podIP="127.0.0.1", podIPs=[{"ip": "127.0.0.1"}])
        status["startTime"] = rfc3339(now())
        set_condition(status, "PodScheduled", "True")
        set_condition(status, "PodReadyToStartContainers", "True")
        set_condition(status, "Initialized", "True")
        set_condition(status, "Ready", "False", "ContainersNotReady", "containers with unready status")
        set_condition(
            status, "ContainersReady", "False", "ContainersNotReady", "containers with unready status"
        )
        _waiting(pod, "ContainerCreating", None)

    def _launch_spec(
        self, pod: dict[str, Any], container: ContainerRuntime
    ) -> tuple[list[str], dict[str, str], str]:
        spec = container.spec
        host_network = bool(pod["spec"].get("hostNetwork"))
        hostname = (
            socket.gethostname() if host_network else pod["spec"].get("hostname") or pod["metadata"]["name"]
        )
        env = {
            **self.image_env,
            "PATH": os.pathsep.join(
                [str(self.bin_dir), str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
            ),
            "HOSTNAME": hostname,
            "HOME": str(container.directory),
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        }
        if not host_network:  # the pod's own UTS namespace (POD_HOSTNAME)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.uts_dir), env.get("PYTHONPATH")]))
        if self.termination_message_env:
            env[self.termination_message_env] = str(container.termination_log)
        for source in spec.get("envFrom") or []:
            env.update(self._env_from(pod, source))
        declared: dict[str, str] = {}
        for var in spec.get("env") or []:
            if "valueFrom" in var and var["valueFrom"] is not None:
                value = self._value_from(pod, var["name"], var["valueFrom"])
                if value is None:
                    continue
            else:
                value = expand(var.get("value") or "", {**env, **declared})
            declared[var["name"]] = value
        env.update(declared)
        command = [expand(a, env) for a in spec.get("command") or []]
        args = [expand(a, env) for a in spec.get("args") or []]
        if not command:
            raise ContainerConfigError(
                f'container "{container.name}" has no command: the loopback API ignores images, '
                "so it cannot know their ENTRYPOINT"
            )
        working_dir = spec.get("workingDir") or str(container.directory)
        return [*command, *args], env, working_dir

    def _secret(self, pod: dict[str, Any], name: str, optional: bool) -> dict[str, str] | None:
        secret = self.api.get_object("secrets", pod["metadata"]["namespace"], name)
        if secret is None:
            if optional:
                return None
            raise ContainerConfigError(f'secret "{name}" not found')
        return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}

    def _env_from(self, pod: dict[str, Any], source: Mapping[str, Any]) -> dict[str, str]:
        prefix = source.get("prefix") or ""
        if source.get("secretRef"):
            ref = source["secretRef"]
            data = self._secret(pod, ref["name"], bool(ref.get("optional")))
            return {prefix + k: v for k, v in (data or {}).items()}
        if source.get("configMapRef"):
            ref = source["configMapRef"]
            if ref.get("optional"):
                return {}
            raise ContainerConfigError(f'configmap "{ref["name"]}" not found (ConfigMaps are not modeled)')
        return {}

    def _value_from(self, pod: dict[str, Any], var: str, source: Mapping[str, Any]) -> str | None:
        if source.get("secretKeyRef"):
            ref = source["secretKeyRef"]
            data = self._secret(pod, ref["name"], bool(ref.get("optional")))
            if data is None:
                return None
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                raise ContainerConfigError(
                    f"couldn't find key {ref['key']} in Secret {pod['metadata']['namespace']}/{ref['name']}"
                )
            return data[ref["key"]]
        if source.get("fieldRef"):
            return _field_ref(pod, source["fieldRef"]["fieldPath"])
        if source.get("configMapKeyRef"):
            ref = source["configMapKeyRef"]
            if ref.get("optional"):
                return None
            raise ContainerConfigError(f'configmap "{ref["name"]}" not found (ConfigMaps are not modeled)')
        raise ContainerConfigError(
            f"env {var}: valueFrom {sorted(source)} is not modeled by the loopback API"
        )

    def _start(
        self, runtime: PodRuntime, container: ContainerRuntime, argv: list[str], env: dict[str, str], cwd: str
    ) -> None:
        container.started_at = now()
        try:
            container.process = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # one process group per container: SIGKILL reaches all of it
            )
        except OSError as exc:
            container.finished_at = now()
            container.terminated = True
            message = f"exec: {argv[0]!r}: {exc.strerror or exc}"
            container.log.append(LogLine(now(), f"{message}\n".encode()))
            self.api.record_event(
                runtime.namespace,
                runtime.name,
                runtime.uid,
                "Warning",
                "Failed",
                f"Error: failed to start container {container.name!r}: {message}",
                container=container.name,
            )
            self.api.mutate_pod(
                (runtime.namespace, runtime.name, runtime.uid),
                lambda p: _set_container_state(
                    p,
                    container.name,
                    {"terminated": _terminated(container, 128, "StartError", message)},
                ),
            )
            return
        container.reader = threading.Thread(
            target=self._read_output,
            args=(container,),
            name=f"log-{runtime.name}-{container.name}",
            daemon=True,
        )
        container.reader.start()
        for reason, message in (
            (
                "Pulled",
                f'Container image "{container.spec.get("image")}" ignored: the command runs locally',
            ),
            ("Created", f"Created container {container.name}"),
            ("Started", f"Started container {container.name}"),
        ):
            self.api.record_event(
                runtime.namespace,
                runtime.name,
                runtime.uid,
                "Normal",
                reason,
                message,
                container=container.name,
            )

    def _read_output(self, container: ContainerRuntime) -> None:
        assert container.process is not None and container.process.stdout is not None
        stream = container.process.stdout
        for line in iter(stream.readline, b""):
            with self.api.lock:
                container.log.append(LogLine(now(), line))
                self.api.changed.notify_all()
        stream.close()
        with self.api.lock:
            container.finished_at = now()

    def _stop(self, containers: list[ContainerRuntime], grace_s: float) -> None:
        for container in containers:
            assert container.process is not None
            _signal_main(container.process, signal.SIGTERM)
        deadline = _monotonic() + max(0.0, grace_s)
        for container in containers:
            assert container.process is not None
            try:
                container.process.wait(timeout=max(0.0, deadline - _monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(container.process, signal.SIGKILL)

    # ---------------------------------------------------------------------------- pod status

    def _status_running(self, pod: dict[str, Any], runtime: PodRuntime) -> None:
        status = pod["status"]
        for container in runtime.containers:
            if container.process is not None:
                _set_container_state(
                    pod,
                    container.name,
                    {"running": {"startedAt": rfc3339(container.started_at or now())}},
                    ready=True,
                    started=True,
                    container_id=f"loopback://{container.process.pid}",
                )
        if all(c.process is not None for c in runtime.containers):
            status["phase"] = "Running"
            set_condition(status, "Ready", "True")
            set_condition(status, "ContainersReady", "True")

    def _status_terminated(self, pod: dict[str, Any], *, container: ContainerRuntime) -> None:
        if container.process is None:
            return  # StartError: recorded when the start failed
        code = container.process.returncode
        exit_code = code if code >= 0 else 128 - code
        message = self._termination_message(container, exit_code)
        _set_container_state(
            pod,
            container.name,
            {
                "terminated": _terminated(
                    container, exit_code, "Completed" if exit_code == 0 else "Error", message
                )
            },
            ready=False,
            started=False,
        )
        status = pod["status"]
        set_condition(status, "Ready", "False", "PodCompleted" if exit_code == 0 else "ContainersNotReady")
        set_condition(
            status, "ContainersReady", "False", "PodCompleted" if exit_code == 0 else "ContainersNotReady"
        )

    def _termination_message(self, container: ContainerRuntime, exit_code: int) -> str | None:
        message = ""
        with contextlib.suppress(FileNotFoundError):
            message = container.termination_log.read_bytes()[:MAX_TERMINATION_MESSAGE].decode(
                errors="replace"
            )
        policy = container.spec.get("terminationMessagePolicy") or "File"
        if not message and exit_code != 0 and policy == "FallbackToLogsOnError":
            tail = b"".join(line.data for line in container.log[-FALLBACK_LOG_LINES:])
            message = tail[-FALLBACK_LOG_BYTES:].decode(errors="replace")
        return message or None

    def _status_final(self, pod: dict[str, Any], runtime: PodRuntime) -> None:
        status = pod["status"]
        states = [s.get("state", {}) for s in status.get("containerStatuses") or []]
        codes = [s["terminated"]["exitCode"] for s in states if "terminated" in s]
        if runtime.final_reason is not None:
            status["reason"], status["message"] = runtime.final_reason, runtime.final_message
        if (
            len(codes) == len(runtime.containers)
            and all(c == 0 for c in codes)
            and runtime.final_reason is None
        ):
            status["phase"] = "Succeeded"
        else:
            status["phase"] = "Failed"
        set_condition(status, "PodReadyToStartContainers", "False")


# ------------------------------------------------------------------------------------ helpers


def _monotonic() -> float:
    import time

    return time.monotonic()


def _signal_main(process: subprocess.Popen[bytes], signum: int) -> None:
    """A signal to the container's main process only (what the runtime sends on stop)."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signum)


def _kill_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def set_condition(
    status: dict[str, Any], kind: str, value: str, reason: str | None = None, message: str | None = None
) -> None:
    """Set a pod condition; its ``lastTransitionTime`` moves only when its status changes."""
    conditions = status.setdefault("conditions", [])
    current = next((c for c in conditions if c["type"] == kind), None)
    if current is None:
        current = {"type": kind, "lastProbeTime": None}
        conditions.append(current)
    if current.get("status") != value:
        current["lastTransitionTime"] = rfc3339(now())
    current["status"] = value
    for name, item in (("reason", reason), ("message", message)):
        if item is None:
            current.pop(name, None)
        else:
            current[name] = item


def _container_status(pod: dict[str, Any], name: str) -> dict[str, Any]:
    statuses = pod["status"].setdefault("containerStatuses", [])
    for status in statuses:
        if status["name"] == name:
            return status
    spec = next(c for c in pod["spec"]["containers"] if c["name"] == name)
    status = {
        "name": name,
        "image": spec.get("image"),
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "started": False,
        "state": {},
        "lastState": {},
    }
    statuses.append(status)
    return status


def _set_container_state(
    pod: dict[str, Any],
    name: str,
    state: dict[str, Any],
    *,
    ready: bool = False,
    started: bool = False,
    container_id: str | None = None,
) -> None:
    status = _container_status(pod, name)
    status.update(state=state, ready=ready, started=started)
    if container_id:
        status["containerID"] = container_id


def _waiting(pod: dict[str, Any], reason: str, message: str | None) -> None:
    for container in pod["spec"]["containers"]:
        waiting = {"reason": reason, **({"message": message} if message else {})}
        _set_container_state(pod, container["name"], {"waiting": waiting})


def _terminated(
    container: ContainerRuntime, exit_code: int, reason: str, message: str | None
) -> dict[str, Any]:
    terminated: dict[str, Any] = {
        "exitCode": exit_code,
        "reason": reason,
        "startedAt": rfc3339(container.started_at or now()),
        "finishedAt": rfc3339(container.finished_at or now()),
    }
    if container.process is not None:
        terminated["containerID"] = f"loopback://{container.process.pid}"
        if container.process.returncode < 0:
            terminated["signal"] = -container.process.returncode
    if message:
        terminated["message"] = message
    return terminated


def _field_ref(pod: dict[str, Any], path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    simple: dict[str, Callable[[], Any]] = {
        "metadata.name": lambda: meta["name"],
        "metadata.namespace": lambda: meta["namespace"],
        "metadata.uid": lambda: meta["uid"],
        "spec.nodeName": lambda: spec.get("nodeName"),
        "spec.serviceAccountName": lambda: spec.get("serviceAccountName") or "default",
        "status.hostIP": lambda: status.get("hostIP"),
        "status.podIP": lambda: status.get("podIP"),
    }
    if path in simple:
        return str(simple[path]() or "")
    if match := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise ContainerConfigError(f"fieldRef {path!r} is not supported")
