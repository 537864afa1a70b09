"""One KEDA scenario's world: its namespace, gpuscaler processes, ScaledObjects, and a record of every replica change.

``Scenario`` starts agents (fake GPUs, optionally a fake kubelet) and gateways as real processes, applies objects to
the control plane, and watches Deployments so a test can wait for ``spec.replicas`` and read every step it took.
Teardown deletes the ScaledObjects first (KEDA stops calling), then stops the processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.keda.control_plane import RESOURCES, ApiError, ControlPlane, Json, deployment
from e2e.support.agent import CONSOLE_SCRIPT
from e2e.support.certs import SERVER_NAME, TlsFiles
from e2e.support.clients import query_json
from e2e.support.process import Process, environment
from gpuscaler.client.hpa import MetricType, desired_replicas
from tests.fakes.fake_kubelet import FakeKubelet, short_socket_path

POLL_SECONDS = 0.2
GPUS = 2


@dataclass
class Measurements:
    """Numbers the suite prints at the end (push latency, HPA steps), by scenario."""

    lines: list[str] = field(default_factory=list)

    def add(self, scenario: str, what: str) -> None:
        self.lines.append(f"{scenario}: {what}")


class ReplicaHistory:
    """Every ``spec.replicas`` a Deployment had since it was watched, from the API server's watch stream."""

    def __init__(self, plane: ControlPlane, namespace_name: str, name: str) -> None:
        self.name = name
        self._changes: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set when the watch stream ends, so a wait that times out says the record stopped, not that nothing moved.
        self.ended = ""
        path = f"/apis/apps/v1/namespaces/{namespace_name}/deployments?fieldSelector=metadata.name%3D{name}"
        self._thread = threading.Thread(target=self._watch, args=(plane, path), name=f"watch-{name}", daemon=True)
        self._thread.start()

    def _watch(self, plane: ControlPlane, path: str) -> None:
        def on_event(event: Json) -> None:
            replicas = int(event.get("object", {}).get("spec", {}).get("replicas", 0))
            with self._lock:
                if not self._changes or self._changes[-1][1] != replicas:
                    self._changes.append((time.monotonic(), replicas))

        try:
            plane.kube.watch(path, on_event, self._stop)
        except Exception as error:  # the API server going away at teardown ends the stream too
            self.ended = f"watch ended: {error!r}"
        else:
            self.ended = "watch ended"

    def stop(self) -> None:
        self._stop.set()

    @property
    def changes(self) -> list[tuple[float, int]]:
        with self._lock:
            return list(self._changes)

    @property
    def steps(self) -> list[int]:
        """The distinct replica counts in order, e.g. [0, 1, 3, 0]."""
        return [replicas for _, replicas in self.changes]

    @property
    def current(self) -> int | None:
        changes = self.changes
        return changes[-1][1] if changes else None

    def describe(self) -> str:
        steps = " -> ".join(str(step) for step in self.steps)
        return f"{steps} ({self.ended})" if self.ended else steps

    async def wait_for(
        self, accept: Callable[[int], bool], timeout: float, what: str, *, after: float = 0.0
    ) -> tuple[float, int]:
        """The first change at or after ``after`` (monotonic) whose count ``accept``s, as (monotonic time, count)."""
        deadline = time.monotonic() + timeout
        while True:
            for at, replicas in self.changes:
                if at >= after and accept(replicas):
                    return at, replicas
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name}: replicas never became {what} within {timeout:g}s; steps: {self.describe()}"
                )
            await asyncio.sleep(0.05)

    async def wait_equal(self, expected: int, timeout: float, *, after: float = 0.0) -> float:
        """Waits for the first change at or after ``after`` to ``expected``; the monotonic time of that change."""
        at, _ = await self.wait_for(lambda replicas: replicas == expected, timeout, f"{expected}", after=after)
        return at

    async def hold(self, expected: int, seconds: float) -> None:
        """Asserts the count is ``expected`` now and stays so for ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            current = self.current
            assert current == expected, (
                f"{self.name}: replicas left {expected} (now {current}) while held; steps: {self.describe()}"
            )
            await asyncio.sleep(0.1)


@dataclass
class Scenario:
    """The processes and objects of one test, in its own namespace."""

    plane: ControlPlane
    namespace: str
    directory: Path
    measurements: Measurements
    label: str
    processes: list[Process] = field(default_factory=list)
    kubelets: list[FakeKubelet] = field(default_factory=list)
    objects: list[Json] = field(default_factory=list)
    histories: list[ReplicaHistory] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)

    # --- processes ---------------------------------------------------------------------------------------

    async def agent(
        self,
        node: str = "node-1",
        *,
        gpus: int = GPUS,
        tls: TlsFiles | None = None,
        mtls: bool = False,
        kubelet: FakeKubelet | None = None,
    ) -> Process:
        """``gpuscaler serve --collector fake`` on an ephemeral loopback port; idle GPUs, named GPU-fake-<node>-N."""
        argv = [
            str(CONSOLE_SCRIPT),
            "serve",
            "--collector",
            "fake",
            "--fake-gpus",
            str(gpus),
            "--poll-interval",
            str(POLL_SECONDS),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "",
            "--pod-resources-socket",
            str(kubelet.socket_path) if kubelet else "",
            "--log-format",
            "json",
            "--drain-timeout",
            "1",
        ]
        if tls is not None:
            argv += ["--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key)]
            if mtls:
                argv += ["--tls-client-ca", str(tls.ca)]
        process = Process(argv, self.directory / f"agent-{node}.log", environment(node), "agent_started")
        await asyncio.to_thread(process.start)
        self.processes.append(process)
        return process

    async def gateway(
        self, agents: Sequence[Process], *, pod_directory: Path | str | None = None, flags: Sequence[str] = ()
    ) -> Process:
        """``gpuscaler gateway --agents ...`` on an ephemeral loopback port; ``pod_directory`` "kubernetes" watches
        this control plane's pods (through its kubeconfig); ``flags`` are added as given."""
        argv = [
            str(CONSOLE_SCRIPT),
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--agents",
            ",".join(f"127.0.0.1:{agent.port}" for agent in agents),
            "--log-format",
            "json",
            "--drain-timeout",
            "1",
        ]
        if pod_directory is not None:
            argv += ["--pod-directory", str(pod_directory)]
        argv += flags
        environ = environment()
        if pod_directory == "kubernetes":
            assert self.plane.kubeconfig is not None
            environ["KUBECONFIG"] = str(self.plane.kubeconfig)
        process = Process(argv, self.directory / f"gateway-{len(self.processes)}.log", environ, "gateway_started")
        await asyncio.to_thread(process.start)
        self.processes.append(process)
        return process

    async def kubelet(self) -> FakeKubelet:
        """A fake kubelet's PodResources server on a unix socket, served on the test's event loop."""
        fake = await FakeKubelet(short_socket_path()).start()
        self.kubelets.append(fake)
        return fake

    def kill(self, process: Process) -> None:
        """SIGKILL: a crash, with no orderly end of KEDA's streams."""
        assert process.process is not None
        self.killed.add(process.process.pid)
        process.kill()

    async def fake_set(self, agent: Process, gpu: int | str, tls: TlsFiles | None = None, **values: float) -> float:
        """``gpuscaler fake set`` as a user types it; returns the monotonic time it returned (values applied)."""
        argv = [str(CONSOLE_SCRIPT), "fake", "set", "--address", f"127.0.0.1:{agent.port}", "--gpu", str(gpu)]
        argv += _tls_flags(tls, agent)
        argv += [f"{key}={value:g}" for key, value in values.items()]
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        async with asyncio.timeout(60):
            output, _ = await process.communicate()
        assert process.returncode == 0, f"{' '.join(argv)} exited {process.returncode}:\n{output.decode()}"
        return time.monotonic()

    async def fake_fail(self, agent: Process, gpu: int, error: str) -> None:
        """``gpuscaler fake fail``: the GPU's reads fail with ``error`` (lost, not_supported, timeout) from now on."""
        argv = [str(CONSOLE_SCRIPT), "fake", "fail", "--address", f"127.0.0.1:{agent.port}"]
        argv += ["--gpu", str(gpu), "--error", error]
        result = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}{result.stderr}"

    def pause(self, process: Process, sig: signal.Signals) -> None:
        """SIGSTOP makes a process silent without closing its sockets (a hung node); SIGCONT resumes it."""
        assert process.process is not None
        os.kill(process.process.pid, sig)

    async def query(
        self,
        scaler: Process,
        metadata: Mapping[str, str],
        tls: TlsFiles | None = None,
        *,
        scaled_object: str | None = None,
    ) -> Json:
        """``gpuscaler query --output json``: the four RPCs as KEDA makes them (for ``scaled_object``,
        NAMESPACE/NAME, when given), and the explanation."""
        address = f"127.0.0.1:{scaler.port}"
        return await query_json(address, metadata, scaled_object=scaled_object, flags=_tls_flags(tls, scaler))

    async def metric_value(self, scaler: Process, metadata: Mapping[str, str], tls: TlsFiles | None = None) -> float:
        """The value GetMetrics gives KEDA for ``metadata`` right now; fails if the call fails."""
        answer = await self.query(scaler, metadata, tls)
        metrics = answer["get_metrics"]
        assert metrics["ok"], f"GetMetrics failed: {metrics}"
        return float(metrics["fields"]["metricValues"][0]["metricValueFloat"])

    async def wait_value(
        self, scaler: Process, metadata: Mapping[str, str], expected: float, tls: TlsFiles | None = None
    ) -> float:
        """Waits until the scaler's value is ``expected`` (the agent has sampled a change), then returns it."""
        deadline = time.monotonic() + 30
        last: float | str = "no answer"
        while time.monotonic() < deadline:
            with contextlib.suppress(AssertionError):
                last = await self.metric_value(scaler, metadata, tls)
                if abs(last - expected) < 1e-6:
                    return last
            await asyncio.sleep(0.2)
        raise AssertionError(f"the scaler's value never became {expected} (last: {last})")

    # --- objects -------------------------------------------------------------------------------------

    async def apply(self, document: Json) -> Json:
        """Server-side apply (strict) in this scenario's namespace; ScaledObjects are deleted at teardown."""
        document = dict(document)
        if RESOURCES[(document["apiVersion"], document["kind"])][1]:
            document["metadata"] = {**document.get("metadata", {}), "namespace": self.namespace}
        applied = await asyncio.to_thread(self.plane.kube.apply, document)
        self.objects.append(document)
        return applied

    async def deployment(
        self,
        name: str,
        *,
        replicas: int = 0,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> ReplicaHistory:
        """A Deployment of never-running pods (``annotations`` on each), and the record of its replica changes."""
        await self.apply(deployment(name, self.namespace, replicas=replicas, labels=labels, annotations=annotations))
        history = ReplicaHistory(self.plane, self.namespace, name)
        self.histories.append(history)
        # The watch starts with the object as created: from then on every change is recorded.
        await history.wait_for(lambda seen: seen == replicas, 30, f"{replicas} (the first watch event)")
        return history

    async def get(self, path: str) -> Json | None:
        """The object at ``path``, or None."""
        return await asyncio.to_thread(self.plane.kube.get, path)

    async def scaled_object(self, name: str) -> Json | None:
        return await self.get(f"/apis/keda.sh/v1alpha1/namespaces/{self.namespace}/scaledobjects/{name}")

    async def wait_ready(self, name: str, timeout: float = 60) -> Json:
        """Waits for the ScaledObject's Ready condition to be True; fails with its conditions otherwise."""
        deadline = time.monotonic() + timeout
        found: Json | None = None
        while time.monotonic() < deadline:
            found = await self.scaled_object(name)
            if _condition_status(found, "Ready") == "True":
                assert found is not None
                return found
            self.plane.check_alive()
            await asyncio.sleep(0.2)
        conditions = ((found or {}).get("status") or {}).get("conditions")
        raise AssertionError(f"ScaledObject {name} not Ready within {timeout:g}s: {conditions}")

    async def pods(self, app: str) -> list[Json]:
        """The Deployment's pods (created by its ReplicaSet), oldest first."""
        path = f"/api/v1/namespaces/{self.namespace}/pods?labelSelector=app%3D{app}"
        found = await asyncio.to_thread(self.plane.kube.request, "GET", path)
        items: list[Json] = found["items"]
        return sorted(items, key=lambda pod: (pod["metadata"]["creationTimestamp"], pod["metadata"]["name"]))

    async def wait_pods(self, app: str, count: int) -> list[Json]:
        """The oldest ``count`` pods of Deployment ``app``, once it has that many; fails after 60 s."""
        deadline = time.monotonic() + 60
        while True:
            pods = await self.pods(app)
            if len(pods) >= count:
                return pods[:count]
            assert time.monotonic() < deadline, f"{app}: {len(pods)} pods, expected {count}"
            await asyncio.sleep(0.2)

    async def wait_pod_ips(self, app: str, count: int) -> list[Json]:
        """The oldest ``count`` pods of Deployment ``app`` once each has the IP the pod stand-in gives it."""
        deadline = time.monotonic() + 60
        while True:
            pods = (await self.pods(app))[:count]
            if len(pods) == count and all((pod.get("status") or {}).get("podIP") for pod in pods):
                return pods
            assert time.monotonic() < deadline, f"{app}: pods without IPs after 60 s: {pods}"
            await asyncio.sleep(0.2)

    def record(self, what: str) -> None:
        self.measurements.add(self.label, what)

    # --- teardown ------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Deletes the ScaledObjects (KEDA stops calling), stops watches and processes; fails on a bad exit."""
        for document in reversed(self.objects):
            if document["kind"] == "ScaledObject":
                with contextlib.suppress(ApiError):
                    await asyncio.to_thread(self.plane.kube.delete, document)
        for history in self.histories:
            history.stop()
        failures = []
        for process in reversed(self.processes):
            code = await process.terminate()
            pid = process.process.pid if process.process else 0
            if pid not in self.killed and code != 0:
                failures.append(f"{process.argv[1]} exited {code}:\n{process.tail()}")
        for kubelet in self.kubelets:
            await kubelet.stop()
        assert not failures, "\n\n".join(failures)


def _tls_flags(tls: TlsFiles | None, process: Process) -> list[str]:
    if tls is None:
        return []
    flags = ["--tls-ca", str(tls.ca), "--tls-server-name", SERVER_NAME]
    if "--tls-client-ca" in process.argv:
        flags += ["--tls-cert", str(tls.client_cert), "--tls-key", str(tls.client_key)]
    return flags


def _condition_status(document: Json | None, kind: str) -> str | None:
    for condition in ((document or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return str(condition.get("status"))
    return None


def directory_entry(pod: Json, workload: str) -> Json:
    """A static pod directory's entry for a pod the API server holds: its namespace, name, labels and owning
    Deployment (the ReplicaSet ``<workload>-<pod-template-hash>`` owns it, as the pod watch would tell)."""
    metadata = pod["metadata"]
    owners = metadata.get("ownerReferences") or []
    assert [owner["kind"] for owner in owners] == ["ReplicaSet"], owners
    assert owners[0]["name"] == f"{workload}-{metadata['labels']['pod-template-hash']}", owners
    return {
        "namespace": metadata["namespace"],
        "pod": metadata["name"],
        "labels": metadata["labels"],
        "workload": workload,
        "workloadKind": "Deployment",
    }


def scaled_object(
    name: str,
    *,
    trigger: str,
    metadata: Mapping[str, str],
    target: str | None = None,
    metric_type: MetricType | None = None,
    min_replicas: int = 0,
    max_replicas: int = 10,
    polling_seconds: int = 2,
    cooldown_seconds: int = 5,
    fallback: Mapping[str, Any] | None = None,
    authentication: str | None = None,
) -> Json:
    """A ScaledObject with one external or external-push trigger, scaling the Deployment named ``target``."""
    trigger_spec: Json = {"type": trigger, "metadata": dict(metadata)}
    if metric_type is not None:
        trigger_spec["metricType"] = str(metric_type)
    if authentication is not None:
        trigger_spec["authenticationRef"] = {"name": authentication}
    spec: Json = {
        "scaleTargetRef": {"name": target or name},
        "minReplicaCount": min_replicas,
        "maxReplicaCount": max_replicas,
        "pollingInterval": polling_seconds,
        "cooldownPeriod": cooldown_seconds,
        "triggers": [trigger_spec],
    }
    if fallback is not None:
        spec["fallback"] = dict(fallback)
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": name}, "spec": spec}


def expected_replicas(metric_type: MetricType, *, value: float, target: float, current: int, maximum: int) -> int:
    """The HPA's answer from gpuscaler.client.hpa, clamped to the ScaledObject's bounds as the HPA clamps it."""
    return max(1, min(maximum, desired_replicas(metric_type, value=value, target=target, current=current)))
