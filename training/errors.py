"""User-facing errors, and how any exception is told in one line (no traceback for mistakes)."""
from __future__ import annotations

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException


class UserError(RuntimeError):
    """A mistake in what the user asked for: reported as one line, without a traceback."""


class TrainingDiverged(UserError):
    """The loss or the gradient stopped being finite."""


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """An error as one line. Hydra and OmegaConf spread theirs over several: keep the first line,
    the available options of a missing config, and the first line of the cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0].rstrip(".")
    if isinstance(exc, HydraException):
        if any(line.startswith("Available options") for line in lines):
            start = next(i for i, line in enumerate(lines) if line.startswith("Available options"))
            options = [line for line in lines[start + 1:] if " " not in line and "=" not in line]
            text += f" (available: {', '.join(options)})"
        elif len(lines) > 1 and lines[1].startswith("To append"):
            text += f" ({lines[1].rstrip('.')})"
        cause = exc.__cause__ or exc.__context__
        if cause is not None and first_line(cause) not in text:
            text += f": {first_line(cause)}"
    elif isinstance(exc, OmegaConfBaseException):
        key = getattr(exc, "full_key", None)
        if key and key not in text:
            text += f" ({key})"
    if isinstance(exc, OSError) and not isinstance(exc, HydraException):
        text = f"{exc.strerror or text}: {exc.filename}" if exc.filename else text
    return text
