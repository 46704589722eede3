"""What a server tells apart when a request fails: the model cannot step now (its engine process or
an actor of its pipeline is gone, or recovering), which is a 503 with Retry-After, not a fault of
the request or a bug."""


class ModelUnavailableError(RuntimeError):
    """The model cannot run the request now; it may again after a restart or a recovery."""
