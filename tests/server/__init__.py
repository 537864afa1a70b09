"""Tests of the gRPC side: KEDA's ExternalScaler, the agent's own API, error statuses and the HTTP/2 transport."""
