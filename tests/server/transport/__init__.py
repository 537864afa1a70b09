"""Tests of the gRPC transport: many streams on one connection, and the limits on what a peer may hold or send."""
