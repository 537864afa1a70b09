"""The gpuscaler image: a Debian base pinned by a lock file, a runtime with no shell, its SBOM, and ``make image``."""
