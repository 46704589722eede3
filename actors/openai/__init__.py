"""The OpenAI-compatible HTTP layer: request and response models, routes, serving on an engine client,
error bodies and admission. Nothing here starts or names a Ray actor (errors.py recognizes Ray's
actor-death exception as a 503), so it can front any engine the way vLLM's entrypoints do."""
