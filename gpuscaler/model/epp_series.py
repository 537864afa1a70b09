"""The inference gateway endpoint picker's (EPP's) series, labels and outcomes, as its own source writes them.

Newest first: llm-d's EPP (``llm_d_epp_*``, llm-d/llm-d-router ``pkg/epp/metrics/llm_d_router_metrics.go``), then
the Gateway API Inference Extension's up to v1.5.0 and early llm-d's (``pkg/epp/metrics/metrics.go``), which current
llm-d still writes beside the new ones. docs/engines.md lists the versions read; ``engines.py`` makes them signals.
"""

from __future__ import annotations

EPP_QUEUE_SERIES = ("llm_d_epp_flow_control_queue_size", "inference_extension_flow_control_queue_size")
EPP_QUEUE_WAIT_SERIES = (
    "llm_d_epp_flow_control_request_queue_duration_seconds",
    "inference_extension_flow_control_request_queue_duration_seconds",
)
EPP_SATURATION_SERIES = ("llm_d_epp_flow_control_pool_saturation", "inference_extension_flow_control_pool_saturation")
EPP_RUNNING_SERIES = ("llm_d_epp_request_running", "inference_objective_running_requests")
# Set to 1 when the EPP starts: a page that has it is an EPP's, whatever else it shows yet.
EPP_INFO_SERIES = ("llm_d_epp_info", "inference_extension_info")
# The label flow control writes the pool's name in (the EPP's ``--pool-name``: the name alone, no namespace).
EPP_POOL_LABEL = "inference_pool"
# The outcomes of a request that waited in the queue: dispatched, or evicted after waiting (its TTL, its client
# gone, no endpoint). A rejected request never waited (the queue was full at once), and would pull the mean down
# exactly when the pool is overloaded. GIE v1.5.0 writes Dispatched, EvictedTTL, EvictedContextCancelled and
# EvictedOther (pkg/epp/flowcontrol/types/outcomes.go:71-87); EvictedNoEndpoints is llm-d's alone (llm-d/llm-d-router
# docs/metrics.md, QueueOutcomeEvictedNoEndpoints: its no-endpoint wait budget ran out with the pool empty).
EPP_WAITED_OUTCOMES = frozenset(
    ("Dispatched", "EvictedTTL", "EvictedNoEndpoints", "EvictedContextCancelled", "EvictedOther")
)
