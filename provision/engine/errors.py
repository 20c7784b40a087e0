"""The engine's one user-facing error (stdlib only, so the engine travels without `provision`).

The CLI maps it onto `provision.errors.EngineError`; the server turns request errors into 4xx."""


class EngineError(Exception):
    """Bad checkpoint, config or request: `str()` is one clear line naming the key or file."""
