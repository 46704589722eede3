"""Where API keys come from: `$K3RAY_API_KEY` on both sides; clients also accept `$OPENAI_API_KEY`
(what OpenAI client libraries and lm-eval read)."""

from __future__ import annotations

import os

SERVER_ENV = "K3RAY_API_KEY"
CLIENT_FALLBACK_ENV = "OPENAI_API_KEY"


def client_api_key() -> str | None:
    """The bearer token a k3ray client sends when none is given: $K3RAY_API_KEY, else $OPENAI_API_KEY."""
    return os.environ.get(SERVER_ENV) or os.environ.get(CLIENT_FALLBACK_ENV) or None


CLIENT_API_KEY_HELP = f"bearer token (default ${SERVER_ENV}, else ${CLIENT_FALLBACK_ENV})"
