"""The gRPC transport: grpclib and h2, bounded for KEDA's one connection and for peers that misbehave."""
