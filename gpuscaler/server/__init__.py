"""The gRPC side: KEDA's ExternalScaler, the agent's own API, fake control, health, and the server itself."""
