"""``scaleTargetPods``: a ScaledObject's own scale target, resolved to the pod selection a workload query makes.

KEDA sends every call the ScaledObject's name and namespace. A trigger that opts in (``scaleTargetPods: "true"``,
and no explicit selector) reads the pods of that ScaledObject's ``scaleTargetRef``: a Deployment or StatefulSet,
matched by the pods' owners as ``workload`` matches them. The resolution happens at each evaluation, so an edit
of the ScaledObject takes effect without a reconnect. Anything that cannot be resolved is an error, never a
selection of no pods, because no pods reads as 0 and scales the workload in.
"""

from __future__ import annotations

from gpuscaler.model.errors import GpuscalerError, Unavailable, Unsupported
from gpuscaler.model.pods import SCALE_TARGET_KINDS, PodDirectory, ScaleTargets
from gpuscaler.query.query import PodSelection

WAY_OUT = "or select the pods with workload or podSelector"


def resolve(pods: PodSelection, directory: PodDirectory | None) -> PodSelection | GpuscalerError:
    """The workload selection ``pods.scale_target``'s ScaledObject points at, or the error KEDA must get."""
    assert pods.scale_target is not None
    scaled_object = f"{pods.namespace}/{pods.scale_target}"
    known: object = directory  # a directory may know ScaledObjects too: the protocol is checked at run time
    if not isinstance(known, ScaleTargets):
        return Unsupported(
            f"scaleTargetPods selects the pods of ScaledObject {scaled_object}'s scaleTargetRef, and this server does "
            "not read ScaledObjects; point scalerAddress at the gateway started with --pod-directory kubernetes "
            f"(a node agent never reads them), {WAY_OUT}"
        )
    problem = known.scale_targets_problem()
    if problem is not None:
        return Unavailable(f"scaleTargetPods needs ScaledObject {scaled_object}: {problem}")
    target = known.scale_target(pods.namespace, pods.scale_target)
    if target is None:
        return Unavailable(
            f"scaleTargetPods: the gateway knows no ScaledObject {scaled_object} (one created a moment ago appears "
            "with the next watch event; a ScaledJob has no scaleTargetRef; `gpuscaler query` needs --scaled-object "
            f"NAMESPACE/NAME), {WAY_OUT}"
        )
    if target.kind not in SCALE_TARGET_KINDS or not target.api_version.startswith("apps/"):
        return Unsupported(
            f"ScaledObject {scaled_object} scales {target.kind} {target.name} ({target.api_version}); the gateway "
            f"tells a pod's workload by its owner, which it knows for {' and '.join(sorted(SCALE_TARGET_KINDS))} "
            "only, so it cannot tell that target's pods; select them with podSelector (their labels)"
        )
    return PodSelection(
        namespace=pods.namespace,
        workload=target.name,
        workload_kind=target.kind,
        pod_aggregation=pods.pod_aggregation,
        origin=f"the scaleTargetRef of ScaledObject {scaled_object} (scaleTargetPods)",
    )
