"""Docker Compose (the Go CLI), built once per machine from its pinned Go module into the shared tool cache.

``go install github.com/docker/compose/v5/cmd@VERSION`` is refused (the module's go.mod has exclude directives), so
it is built like e2e-keda's tools (e2e/keda/tools.py: the same cache, file lock and recipe versioning) from a
generated module that requires it and repeats its exclude lines. The binary runs standalone as ``docker-compose``
(no Docker CLI needed), against whatever Docker API ``DOCKER_HOST`` names.
"""

from __future__ import annotations

from e2e.keda.tools import Tool

COMPOSE_MODULE = "github.com/docker/compose/v5"
# The newest Docker Compose release the module proxy serves; its go.mod asks for Go 1.26.8.
COMPOSE_VERSION = "v5.6.0"
COMPOSE = Tool(
    "docker-compose",
    COMPOSE_MODULE,
    COMPOSE_VERSION,
    (("docker-compose", f"{COMPOSE_MODULE}/cmd"),),
    # What `docker compose version` prints; compose's own build stamps it (its Dockerfile's GO_LDFLAGS).
    (f"{COMPOSE_MODULE}/internal.Version={COMPOSE_VERSION}",),
    keeps_directives=True,
)
