"""The engine's one user-facing error. It travels to hosts with the engine and `provision/errors.py` (stdlib
only); the CLI edge shows it as any input error (one line, exit 2); the server turns request errors into 4xx."""
from ..errors import InputError


class EngineError(InputError):
    """Bad checkpoint, config or request: `str()` is one clear line naming the key or file."""
