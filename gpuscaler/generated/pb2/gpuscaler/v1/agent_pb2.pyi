from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReadErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    READ_ERROR_KIND_UNSPECIFIED: _ClassVar[ReadErrorKind]
    READ_ERROR_KIND_NOT_SUPPORTED: _ClassVar[ReadErrorKind]
    READ_ERROR_KIND_GPU_LOST: _ClassVar[ReadErrorKind]
    READ_ERROR_KIND_TIMEOUT: _ClassVar[ReadErrorKind]
    READ_ERROR_KIND_OTHER: _ClassVar[ReadErrorKind]

class AttributionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTRIBUTION_STATE_UNSPECIFIED: _ClassVar[AttributionState]
    ATTRIBUTION_STATE_OFF: _ClassVar[AttributionState]
    ATTRIBUTION_STATE_UNAVAILABLE: _ClassVar[AttributionState]
    ATTRIBUTION_STATE_OK: _ClassVar[AttributionState]
READ_ERROR_KIND_UNSPECIFIED: ReadErrorKind
READ_ERROR_KIND_NOT_SUPPORTED: ReadErrorKind
READ_ERROR_KIND_GPU_LOST: ReadErrorKind
READ_ERROR_KIND_TIMEOUT: ReadErrorKind
READ_ERROR_KIND_OTHER: ReadErrorKind
ATTRIBUTION_STATE_UNSPECIFIED: AttributionState
ATTRIBUTION_STATE_OFF: AttributionState
ATTRIBUTION_STATE_UNAVAILABLE: AttributionState
ATTRIBUTION_STATE_OK: AttributionState

class GetSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchSnapshotsRequest(_message.Message):
    __slots__ = ("windows",)
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    windows: _containers.RepeatedCompositeFieldContainer[WindowSpec]
    def __init__(self, windows: _Optional[_Iterable[_Union[WindowSpec, _Mapping]]] = ...) -> None: ...

class WindowSpec(_message.Message):
    __slots__ = ("metric", "seconds", "function")
    METRIC_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    metric: str
    seconds: float
    function: str
    def __init__(self, metric: _Optional[str] = ..., seconds: _Optional[float] = ..., function: _Optional[str] = ...) -> None: ...

class WindowedValue(_message.Message):
    __slots__ = ("reason", "shares")
    REASON_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    reason: str
    shares: _containers.RepeatedCompositeFieldContainer[PodWindowedValue]
    def __init__(self, reason: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[PodWindowedValue, _Mapping]]] = ...) -> None: ...

class PodWindowedValue(_message.Message):
    __slots__ = ("pod_uid", "value", "samples", "covered_seconds")
    POD_UID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COVERED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pod_uid: str
    value: float
    samples: int
    covered_seconds: float
    def __init__(self, pod_uid: _Optional[str] = ..., value: _Optional[float] = ..., samples: _Optional[int] = ..., covered_seconds: _Optional[float] = ...) -> None: ...

class WindowedValues(_message.Message):
    __slots__ = ("window", "problem", "packed_values", "packed_samples", "details", "packed_covered_seconds")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    PACKED_VALUES_FIELD_NUMBER: _ClassVar[int]
    PACKED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    PACKED_COVERED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    window: WindowSpec
    problem: str
    packed_values: _containers.RepeatedScalarFieldContainer[float]
    packed_samples: _containers.RepeatedScalarFieldContainer[int]
    details: _containers.RepeatedCompositeFieldContainer[WindowedValue]
    packed_covered_seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, window: _Optional[_Union[WindowSpec, _Mapping]] = ..., problem: _Optional[str] = ..., packed_values: _Optional[_Iterable[float]] = ..., packed_samples: _Optional[_Iterable[int]] = ..., details: _Optional[_Iterable[_Union[WindowedValue, _Mapping]]] = ..., packed_covered_seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class ReadError(_message.Message):
    __slots__ = ("field", "kind", "detail", "last_read_unix_seconds")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    LAST_READ_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    field: str
    kind: ReadErrorKind
    detail: str
    last_read_unix_seconds: float
    def __init__(self, field: _Optional[str] = ..., kind: _Optional[_Union[ReadErrorKind, str]] = ..., detail: _Optional[str] = ..., last_read_unix_seconds: _Optional[float] = ...) -> None: ...

class Attribution(_message.Message):
    __slots__ = ("state", "detail", "unplaced")
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UNPLACED_FIELD_NUMBER: _ClassVar[int]
    state: AttributionState
    detail: str
    unplaced: _containers.RepeatedCompositeFieldContainer[UnplacedDevice]
    def __init__(self, state: _Optional[_Union[AttributionState, str]] = ..., detail: _Optional[str] = ..., unplaced: _Optional[_Iterable[_Union[UnplacedDevice, _Mapping]]] = ...) -> None: ...

class UnplacedDevice(_message.Message):
    __slots__ = ("pod", "device", "kind", "detail")
    POD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    pod: PodRef
    device: str
    kind: ReadErrorKind
    detail: str
    def __init__(self, pod: _Optional[_Union[PodRef, _Mapping]] = ..., device: _Optional[str] = ..., kind: _Optional[_Union[ReadErrorKind, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class PodRef(_message.Message):
    __slots__ = ("namespace", "pod", "container")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    pod: str
    container: str
    def __init__(self, namespace: _Optional[str] = ..., pod: _Optional[str] = ..., container: _Optional[str] = ...) -> None: ...

class ProcessUsage(_message.Message):
    __slots__ = ("pid", "pod_uid", "container_id", "sm_percent", "memory_utilization_percent", "memory_used_bytes")
    PID_FIELD_NUMBER: _ClassVar[int]
    POD_UID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    SM_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    pod_uid: str
    container_id: str
    sm_percent: float
    memory_utilization_percent: float
    memory_used_bytes: int
    def __init__(self, pid: _Optional[int] = ..., pod_uid: _Optional[str] = ..., container_id: _Optional[str] = ..., sm_percent: _Optional[float] = ..., memory_utilization_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ...) -> None: ...

class GpuSample(_message.Message):
    __slots__ = ("index", "uuid", "name", "mig_parent_uuid", "node", "errors", "pods", "processes", "processes_read")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIG_PARENT_UUID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_READ_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    mig_parent_uuid: str
    node: str
    errors: _containers.RepeatedCompositeFieldContainer[ReadError]
    pods: _containers.RepeatedCompositeFieldContainer[PodRef]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessUsage]
    processes_read: bool
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., mig_parent_uuid: _Optional[str] = ..., node: _Optional[str] = ..., errors: _Optional[_Iterable[_Union[ReadError, _Mapping]]] = ..., pods: _Optional[_Iterable[_Union[PodRef, _Mapping]]] = ..., processes: _Optional[_Iterable[_Union[ProcessUsage, _Mapping]]] = ..., processes_read: _Optional[bool] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("node", "sequence", "taken_at_unix_seconds", "poll_interval_seconds", "gpus", "attribution", "windows", "readings")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TAKEN_AT_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    READINGS_FIELD_NUMBER: _ClassVar[int]
    node: str
    sequence: int
    taken_at_unix_seconds: float
    poll_interval_seconds: float
    gpus: _containers.RepeatedCompositeFieldContainer[GpuSample]
    attribution: Attribution
    windows: _containers.RepeatedCompositeFieldContainer[WindowedValues]
    readings: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, node: _Optional[str] = ..., sequence: _Optional[int] = ..., taken_at_unix_seconds: _Optional[float] = ..., poll_interval_seconds: _Optional[float] = ..., gpus: _Optional[_Iterable[_Union[GpuSample, _Mapping]]] = ..., attribution: _Optional[_Union[Attribution, _Mapping]] = ..., windows: _Optional[_Iterable[_Union[WindowedValues, _Mapping]]] = ..., readings: _Optional[_Iterable[float]] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("scaler_metadata", "name", "namespace")
    class ScalerMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCALER_METADATA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    scaler_metadata: _containers.ScalarMap[str, str]
    name: str
    namespace: str
    def __init__(self, scaler_metadata: _Optional[_Mapping[str, str]] = ..., name: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class GpuContribution(_message.Message):
    __slots__ = ("index", "uuid", "node", "included", "value", "samples", "reason", "namespace", "pod", "share", "covered_seconds")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    COVERED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    node: str
    included: bool
    value: float
    samples: int
    reason: str
    namespace: str
    pod: str
    share: str
    covered_seconds: float
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., node: _Optional[str] = ..., included: _Optional[bool] = ..., value: _Optional[float] = ..., samples: _Optional[int] = ..., reason: _Optional[str] = ..., namespace: _Optional[str] = ..., pod: _Optional[str] = ..., share: _Optional[str] = ..., covered_seconds: _Optional[float] = ...) -> None: ...

class PodContribution(_message.Message):
    __slots__ = ("namespace", "pod", "workload", "node", "included", "value", "gpus", "reason", "age_seconds", "signal", "covered_seconds")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    COVERED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    pod: str
    workload: str
    node: str
    included: bool
    value: float
    gpus: int
    reason: str
    age_seconds: float
    signal: str
    covered_seconds: float
    def __init__(self, namespace: _Optional[str] = ..., pod: _Optional[str] = ..., workload: _Optional[str] = ..., node: _Optional[str] = ..., included: _Optional[bool] = ..., value: _Optional[float] = ..., gpus: _Optional[int] = ..., reason: _Optional[str] = ..., age_seconds: _Optional[float] = ..., signal: _Optional[str] = ..., covered_seconds: _Optional[float] = ...) -> None: ...

class Explanation(_message.Message):
    __slots__ = ("metric_name", "metric", "profile", "aggregation", "window_seconds", "window_function", "target", "activation_threshold", "deactivation_threshold", "gpus", "value", "active", "error_code", "error_message", "snapshot_age_seconds", "snapshot_sequence", "nodes", "pods", "nodes_expected", "pod_aggregation", "selection", "absent", "idle_energy", "gpus_omitted", "signals", "empty_selection", "least_covered_seconds", "gpus_filling", "least_covered_node")
    METRIC_NAME_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DEACTIVATION_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    NODES_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    POD_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    IDLE_ENERGY_FIELD_NUMBER: _ClassVar[int]
    GPUS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    EMPTY_SELECTION_FIELD_NUMBER: _ClassVar[int]
    LEAST_COVERED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FILLING_FIELD_NUMBER: _ClassVar[int]
    LEAST_COVERED_NODE_FIELD_NUMBER: _ClassVar[int]
    metric_name: str
    metric: str
    profile: str
    aggregation: str
    window_seconds: float
    window_function: str
    target: float
    activation_threshold: float
    deactivation_threshold: float
    gpus: _containers.RepeatedCompositeFieldContainer[GpuContribution]
    value: float
    active: bool
    error_code: str
    error_message: str
    snapshot_age_seconds: float
    snapshot_sequence: int
    nodes: int
    pods: _containers.RepeatedCompositeFieldContainer[PodContribution]
    nodes_expected: int
    pod_aggregation: str
    selection: str
    absent: _containers.RepeatedCompositeFieldContainer[AbsentNode]
    idle_energy: IdleEnergy
    gpus_omitted: int
    signals: _containers.RepeatedCompositeFieldContainer[SignalPart]
    empty_selection: EmptySelection
    least_covered_seconds: float
    gpus_filling: int
    least_covered_node: str
    def __init__(self, metric_name: _Optional[str] = ..., metric: _Optional[str] = ..., profile: _Optional[str] = ..., aggregation: _Optional[str] = ..., window_seconds: _Optional[float] = ..., window_function: _Optional[str] = ..., target: _Optional[float] = ..., activation_threshold: _Optional[float] = ..., deactivation_threshold: _Optional[float] = ..., gpus: _Optional[_Iterable[_Union[GpuContribution, _Mapping]]] = ..., value: _Optional[float] = ..., active: _Optional[bool] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., snapshot_age_seconds: _Optional[float] = ..., snapshot_sequence: _Optional[int] = ..., nodes: _Optional[int] = ..., pods: _Optional[_Iterable[_Union[PodContribution, _Mapping]]] = ..., nodes_expected: _Optional[int] = ..., pod_aggregation: _Optional[str] = ..., selection: _Optional[str] = ..., absent: _Optional[_Iterable[_Union[AbsentNode, _Mapping]]] = ..., idle_energy: _Optional[_Union[IdleEnergy, _Mapping]] = ..., gpus_omitted: _Optional[int] = ..., signals: _Optional[_Iterable[_Union[SignalPart, _Mapping]]] = ..., empty_selection: _Optional[_Union[EmptySelection, _Mapping]] = ..., least_covered_seconds: _Optional[float] = ..., gpus_filling: _Optional[int] = ..., least_covered_node: _Optional[str] = ...) -> None: ...

class EmptySelection(_message.Message):
    __slots__ = ("selection", "namespace", "workload", "seen", "seen_as", "namespace_pods", "did_you_mean", "seen_in_namespaces", "namespace_did_you_mean", "message", "did_you_mean_elsewhere")
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    SEEN_AS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_PODS_FIELD_NUMBER: _ClassVar[int]
    DID_YOU_MEAN_FIELD_NUMBER: _ClassVar[int]
    SEEN_IN_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_DID_YOU_MEAN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DID_YOU_MEAN_ELSEWHERE_FIELD_NUMBER: _ClassVar[int]
    selection: str
    namespace: str
    workload: str
    seen: str
    seen_as: _containers.RepeatedScalarFieldContainer[str]
    namespace_pods: int
    did_you_mean: _containers.RepeatedScalarFieldContainer[str]
    seen_in_namespaces: _containers.RepeatedScalarFieldContainer[str]
    namespace_did_you_mean: _containers.RepeatedScalarFieldContainer[str]
    message: str
    did_you_mean_elsewhere: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, selection: _Optional[str] = ..., namespace: _Optional[str] = ..., workload: _Optional[str] = ..., seen: _Optional[str] = ..., seen_as: _Optional[_Iterable[str]] = ..., namespace_pods: _Optional[int] = ..., did_you_mean: _Optional[_Iterable[str]] = ..., seen_in_namespaces: _Optional[_Iterable[str]] = ..., namespace_did_you_mean: _Optional[_Iterable[str]] = ..., message: _Optional[str] = ..., did_you_mean_elsewhere: _Optional[_Iterable[str]] = ...) -> None: ...

class SignalPart(_message.Message):
    __slots__ = ("metric", "target", "value", "replicas", "error_message")
    METRIC_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    metric: str
    target: float
    value: float
    replicas: float
    error_message: str
    def __init__(self, metric: _Optional[str] = ..., target: _Optional[float] = ..., value: _Optional[float] = ..., replicas: _Optional[float] = ..., error_message: _Optional[str] = ...) -> None: ...

class IdleEnergy(_message.Message):
    __slots__ = ("idle_joules", "busy_joules", "seconds", "unknown_seconds", "gpus")
    IDLE_JOULES_FIELD_NUMBER: _ClassVar[int]
    BUSY_JOULES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    idle_joules: float
    busy_joules: float
    seconds: float
    unknown_seconds: float
    gpus: int
    def __init__(self, idle_joules: _Optional[float] = ..., busy_joules: _Optional[float] = ..., seconds: _Optional[float] = ..., unknown_seconds: _Optional[float] = ..., gpus: _Optional[int] = ...) -> None: ...

class AbsentNode(_message.Message):
    __slots__ = ("agent", "node", "since_unix_seconds", "reason")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    agent: str
    node: str
    since_unix_seconds: float
    reason: str
    def __init__(self, agent: _Optional[str] = ..., node: _Optional[str] = ..., since_unix_seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...
