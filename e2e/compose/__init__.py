"""`make e2e-compose`: compose.yaml under Docker Compose (the Go CLI) on podman's Docker API, as a user runs it."""
