"""`make e2e-compose`: compose.yaml under Docker Compose v2 on podman's Docker-compatible API, as a user runs it."""
