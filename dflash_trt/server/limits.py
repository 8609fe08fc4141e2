"""The server's default bounds, stated once for the app and the `serve` flags (a module of its own, so the command
line can name them without importing the server)."""

DEFAULT_MAX_QUEUE = 1024  # requests that may wait beyond the executor's batch before a request gets 503
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # the largest request body read
