"""The gRPC request metadata that marks a call to KEDA's ExternalScaler as a preview: answered as KEDA's would be now,
with nothing kept.

``gpuscaler query`` sends it; KEDA never does. A preview moves no activation state (the hysteresis KEDA's own calls
share), registers no interest (it asks a gateway's agents for no window and keeps no engine pod read), feeds
neither the record of selections that match nothing nor the per-ScaledObject answer series, and logs
nothing as the ScaledObject it names, which need not exist.
"""

from __future__ import annotations

from collections.abc import Mapping

PREVIEW_HEADER = "gpuscaler-preview"
PREVIEW_VALUE = "1"
PREVIEW_METADATA: Mapping[str, str] = {PREVIEW_HEADER: PREVIEW_VALUE}
