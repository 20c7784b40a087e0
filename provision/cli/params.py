"""Plain parameter values without pydantic: typer builds a pydantic validator for every parameter it reads,
which costs a fast verb a fifth of a second; a str, False, a plain decimal int or float within its bounds or a Path is
taken as typer would take it, and anything else (enums, out of bounds, odd input and its error line) still goes
through typer's own validator.
"""
from __future__ import annotations

import re
from pathlib import Path

_INT = re.compile(r"(?:0|[1-9][0-9]{0,17})\Z")
_FLOAT = re.compile(r"(?:0|[1-9][0-9]{0,8})(?:\.[0-9]{1,9})?\Z")


def install() -> None:
    """Give typer's parameters the plain coercion where it applies (a no-op on typer versions without it)."""
    try:
        from typer import core
        from typer._coercion import RuntimeParam, build_runtime_param
        from typer._param_types import coerce_cli_path, routes_to_path
    except ImportError:
        return
    param_class = getattr(core, "_TyperParameter", None)
    if param_class is None or not hasattr(param_class, "get_runtime_param"):
        return

    class Plain(RuntimeParam):
        def _coerce_value(self, value, param, ctx):
            info = self.parameter_info
            if (self.annotation is str and isinstance(value, str)) or (self.annotation is bool and value is False):
                return value
            if self.annotation is int and (type(value) is int or (isinstance(value, str) and _INT.match(value))) \
                    and (info.min is None or int(value) >= info.min) and (info.max is None or int(value) <= info.max):
                return int(value)
            if self.annotation is float \
                    and (type(value) in (int, float) or (isinstance(value, str) and _FLOAT.match(value))) \
                    and (info.min is None or float(value) >= info.min) \
                    and (info.max is None or float(value) <= info.max):
                return float(value)
            if self.annotation is Path and isinstance(value, (str, Path)):
                return coerce_cli_path(Path(value), info, path_type=Path, param=param, ctx=ctx)
            return build_runtime_param(param.type_descriptor)._coerce_value(value, param, ctx)

    def plain(d) -> bool:
        info = d.parameter_info
        if d.file_annotation is not None or info.parser is not None:
            return False
        if d.annotation is str or d.annotation is bool:
            return True
        if d.annotation is int or d.annotation is float:
            return not info.clamp
        return (d.annotation is Path and info.path_type is None and routes_to_path(d.annotation, info))

    typer_get = param_class.get_runtime_param

    def get_runtime_param(self):
        if self._runtime_param is None and plain(self.type_descriptor):
            d = self.type_descriptor
            self._runtime_param = Plain(parameter_info=d.parameter_info, annotation=d.annotation)
        return typer_get(self)

    param_class.get_runtime_param = get_runtime_param
