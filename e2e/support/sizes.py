"""How big the scale and fuzz tests are: small in CI, full size with ``GPUSCALER_E2E_FULL=1`` (``make e2e-full``)."""

from __future__ import annotations

import os

FULL_ENV = "GPUSCALER_E2E_FULL"
FULL = os.environ.get(FULL_ENV, "") == "1"
FULL_REASON = f"full-size variant: run `make e2e-full` (sets {FULL_ENV}=1)"

# Open StreamIsActive streams on one grpcio channel.
SCALE_STREAMS_CI = 2_000
SCALE_STREAMS_FULL = 10_000

# Hypothesis examples for the metadata fuzz test.
FUZZ_EXAMPLES = 500 if FULL else 50
