"""Limits of the HTTP layer that a server's settings default to (a module of constants, cheap to import)."""

DEFAULT_MAX_BODY_BYTES = 64 * 1024**2  # larger request bodies get 413
