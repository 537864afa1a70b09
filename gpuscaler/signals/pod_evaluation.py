"""A query that selects pods: GPUs grouped by the pods that hold them, each pod reduced, then the pods combined.

A device a selected pod holds that its node could not tie to a GPU (``Attribution.unplaced``) counts as one of the
pod's GPUs that cannot be read: unknown, under the rule for unreadable GPUs, or left out like a GPU without the
metric when NVML can never see it (a GPU passed through to a VM).

A selection that no pod matches is a true 0 (the workload holds no GPU: scaled to zero), but only when every
node's attribution is working and no node that cannot be heard may hold one of its pods; otherwise the answer
fails and says which node and why.
"""

from __future__ import annotations

from gpuscaler.model.aggregation import aggregate
from gpuscaler.model.errors import GpuscalerError, Unavailable, Unsupported
from gpuscaler.model.pods import PodDirectory
from gpuscaler.model.samples import (
    DEVICE_FIELD,
    Absence,
    AttributionState,
    GpuIdentity,
    GpuSample,
    ReadError,
    Snapshot,
    UnplacedDevice,
)
from gpuscaler.query.query import GpuQuery, PodSelection
from gpuscaler.signals.absences import absences_allowed, judge_unreadable, left_out_by_node, no_gpus
from gpuscaler.signals.gpu_values import contribution_of, unreadable_error
from gpuscaler.signals.outcome import (
    Contribution,
    Evaluation,
    HeldPods,
    ListedContributions,
    PodValue,
    failed,
    filling_windows,
)
from gpuscaler.signals.scale_targets import resolve as resolve_scale_target
from gpuscaler.signals.shares import share_basis
from gpuscaler.signals.source import SnapshotSource


def evaluate_pods(
    query: GpuQuery,
    pods: PodSelection,
    snapshot: Snapshot,
    source: SnapshotSource,
    directory: PodDirectory | None,
) -> Evaluation:
    """``query`` over the GPUs of the pods ``pods`` selects (the module says how)."""
    if pods.scale_target is not None:  # scaleTargetPods: the ScaledObject's target, as a workload selection
        resolved = resolve_scale_target(pods, directory)
        if isinstance(resolved, GpuscalerError):
            return failed(query, snapshot, resolved)
        pods = resolved
    cluster = source.cluster
    if cluster and not snapshot.parts:
        # A gateway that hears from no node knows nothing about the workload: not zero, not unsupported.
        return failed(query, snapshot, Unavailable(no_gpus(snapshot, cluster=cluster)))
    failure = _attribution_failure(pods, snapshot, directory)
    if failure is not None:
        return failed(query, snapshot, failure)
    silent = _pod_absences(pods, snapshot, directory)
    gate = absences_allowed(query, snapshot, silent)
    if isinstance(gate, GpuscalerError):
        return failed(query, snapshot, gate)

    groups: dict[tuple[str, str], list[GpuSample]] = {}
    matched: dict[tuple[str, str], bool] = {}
    for sample in snapshot.samples:
        seen: set[tuple[str, str]] = set()
        for ref in sample.pods:
            key = (ref.namespace, ref.pod)
            if key in seen:
                continue  # two containers of one pod on one GPU: the GPU counts once for the pod
            seen.add(key)
            if key not in matched:
                matched[key] = _pod_matches(pods, key, directory)
            if matched[key]:
                groups.setdefault(key, []).append(sample)
    for part in snapshot.nodes:
        held: set[tuple[str, str, str]] = set()
        for device in part.attribution.unplaced:
            key = (device.pod.namespace, device.pod.pod)
            if (*key, device.device) in held:
                continue  # two containers of one pod holding one device: it counts once for the pod
            held.add((*key, device.device))
            if key not in matched:
                matched[key] = _pod_matches(pods, key, directory)
            if matched[key]:
                groups.setdefault(key, []).append(_unplaced_sample(part.node, device))

    contributions: list[Contribution] = []
    values: list[PodValue] = []
    for key, samples in sorted(groups.items()):
        info = directory.lookup(*key) if directory is not None else None
        try:
            own = [
                contribution_of(query, sample, source, pod=key, share=share_basis(sample, query.metric, info))
                for sample in samples
            ]
        except GpuscalerError as unknown:  # the source cannot tell the window (yet)
            return failed(query, snapshot, unknown)
        contributions.extend(own)
        readable = [c.value for c in own if c.value is not None]
        filling = [c.covered_seconds for c in filling_windows(own) if c.covered_seconds is not None]
        nodes = sorted({sample.node for sample in samples})
        values.append(
            PodValue(
                namespace=key[0],
                pod=key[1],
                node=",".join(nodes),
                workload=info.workload if info is not None else None,
                value=aggregate(pods.pod_aggregation, readable) if readable else None,
                gpus=len(samples),
                reason=None if readable else f"none of its {len(samples)} GPU(s) could be read",
                covered_seconds=min(filling, default=None),
            )
        )

    included = [p.value for p in values if p.value is not None]
    error: GpuscalerError | None = None
    value: float | None
    unmatched: PodSelection | None = None
    if not values and not cluster:
        # One node's agent cannot tell a workload at zero from one whose pods run on other nodes;
        # answering 0 would scale it in. Only the gateway's cluster view can say "zero".
        value, error = (
            None,
            Unsupported(
                f"no pod of {pods.describe()} holds a GPU on node {snapshot.node!r}, and a node agent sees only "
                "its own node; point scalerAddress at the gateway for workload queries"
            ),
        )
    elif not values:
        value = 0.0  # no selected pod holds a GPU on any node, and no node that cannot be heard may hold one
        unmatched = pods
    else:
        value = None
        left_out = [c for c in contributions if c.value is None]
        judged = (
            judge_unreadable(
                query,
                snapshot,
                left_out_by_node(snapshot, contributions, cluster=cluster),
                len(contributions) - len(left_out),
                silent,
                cluster=cluster,
            )
            if left_out
            else None
        )
        if isinstance(judged, GpuscalerError):
            error = judged
        else:
            gate = judged if judged is not None else gate
            # minNodes left out these nodes, whose selected GPUs none can be read: as if they were silent.
            gone = {absence.node for absence in gate if absence.heard}
            if included:
                value = aggregate(query.aggregation, included)
            elif all(p.node in gone for p in values):
                value = 0.0  # every selected pod is on a node minNodes lets the answer leave out
            else:
                error = unreadable_error(query.metric, left_out)
    return Evaluation(
        query,
        ListedContributions(contributions),
        value,
        error,
        snapshot,
        tuple(values),
        absent=gate,
        selection=pods.describe(),
        unmatched=unmatched,
    )


def _pod_absences(
    pods: PodSelection, snapshot: Snapshot, directory: PodDirectory | None
) -> list[tuple[Absence, HeldPods]]:
    """The absent nodes that may hold GPUs of the selected pods, with the pods each is known to hold.

    A silent node's share leaves only when the pods it held are known to be gone: deleted, or running
    on another node (the pod directory says so). An agent whose node is not known may hold any pod
    the directory cannot place on a node that is heard.
    """
    relevant: list[tuple[Absence, HeldPods]] = []
    unplaced: bool | None = None
    for absence in snapshot.absent:
        if absence.last is not None:
            # A pod whose devices the node could not place held GPUs there too: it is as unknown as the rest.
            refs = [ref for sample in absence.last.samples for ref in sample.pods]
            refs += [device.pod for device in absence.last.attribution.unplaced]
            held = sorted(
                {
                    (ref.namespace, ref.pod)
                    for ref in refs
                    if _pod_matches(pods, (ref.namespace, ref.pod), directory)
                    and not _gone(ref.namespace, ref.pod, absence.node, directory)
                }
            )
            if held:
                relevant.append((absence, tuple(held)))
            continue
        if unplaced is None:
            unplaced = _may_be_unplaced(pods, snapshot, directory)
        if unplaced:
            relevant.append((absence, ()))
    return relevant


def _gone(namespace: str, pod: str, node: str | None, directory: PodDirectory | None) -> bool:
    """Whether the directory knows that ``pod`` no longer runs on ``node``: deleted, or (re)placed elsewhere."""
    if directory is None or directory.problem() is not None:
        return False
    info = directory.lookup(namespace, pod)
    return info is None or (info.node is not None and info.node != node)


def _may_be_unplaced(pods: PodSelection, snapshot: Snapshot, directory: PodDirectory | None) -> bool:
    """Whether a selected pod that may hold a GPU runs somewhere the view has no snapshot of."""
    if directory is None or directory.problem() is not None:
        return True
    known = {part.node for part in snapshot.nodes} | {a.node for a in snapshot.absent if a.node is not None}
    for info in directory.pods(pods.namespace):
        if info.holds_gpus is False or not _pod_matches(pods, (info.namespace, info.pod), directory):
            continue
        if info.node is None or info.node not in known:
            return True
    return False


def _attribution_failure(
    pods: PodSelection, snapshot: Snapshot, directory: PodDirectory | None
) -> GpuscalerError | None:
    for part in snapshot.nodes:
        if part.attribution.state is AttributionState.OFF:
            return Unsupported(
                f"{pods.describe()} needs to know which pods hold which GPUs, and node {part.node!r} "
                f"does not: {part.attribution.detail}"
            )
        if part.attribution.state is AttributionState.UNAVAILABLE:
            return Unavailable(
                f"{pods.describe()} needs to know which pods hold which GPUs, and node {part.node!r} "
                f"cannot tell now: {part.attribution.detail}"
            )
    if pods.needs_directory:
        if directory is None:
            return Unsupported(
                f"{pods.describe()} needs pod labels and owners, and this server has no pod directory; "
                "ask the gateway (started with --pod-directory), or select by pod name"
            )
        problem = directory.problem()
        if problem is not None:
            return Unavailable(f"{pods.describe()} needs pod labels and owners: {problem}")
    return None


def _unplaced_sample(node: str, device: UnplacedDevice) -> GpuSample:
    """A stand-in sample for a device no GPU carries: nothing read, and the reason as its device-wide error."""
    pod = f"{device.pod.namespace}/{device.pod.pod}"
    return GpuSample(
        gpu=GpuIdentity(index=0, uuid=device.device, name="", unplaced=True),
        node=node,
        errors=(
            ReadError(DEVICE_FIELD, device.kind, f"pod {pod} holds it, and no GPU on {node!r} does: {device.detail}"),
        ),
        pods=(device.pod,),
    )


def _pod_matches(pods: PodSelection, key: tuple[str, str], directory: PodDirectory | None) -> bool:
    if not pods.selects_name(*key):
        return False
    if not pods.needs_directory:
        return True
    info = directory.lookup(*key) if directory is not None else None
    return info is not None and pods.selects(info)  # a pod not seen yet joins at the next evaluation
