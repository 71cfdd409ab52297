"""The errors and warnings phi_torch_jit raises.

Every error derives from :class:`JitError` *and* from the builtin that matches
its meaning, so ``except TypeError`` keeps working for callers that do not
know this library. Messages start with ``phi_torch_jit:``, name the user's
function as ``name (file:line)``, say what went wrong and end with a fix.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = [
    "JitError",
    "ConfigurationError",
    "UsageError",
    "RunEagerly",
    "ValueNotCaptured",
    "SignatureError",
    "OutputError",
    "ReplayError",
    "CustomFunctionError",
    "GradientError",
    "TraceError",
    "GuardError",
    "TorchVersionError",
    "JitWarning",
    "describe_function",
    "describe_error",
    "eager_if_it_raises",
]


class JitError(Exception):
    """Base class of every error raised by phi_torch_jit."""


class ConfigurationError(JitError, ValueError):
    """A jit() argument, engine name, engine option or backend has a value that is not accepted;
    the message lists the accepted ones."""


class UsageError(JitError, TypeError):
    """jit(), custom_gradient() or an engine got the wrong kind of object (not a callable, an
    option the engine does not take)."""


class SignatureError(JitError, TypeError):
    """An argument of a jitted function cannot be traced or used as a cache key."""


class OutputError(JitError, TypeError):
    """A jitted function returned a value that cannot leave a compiled program."""


class ReplayError(JitError, RuntimeError):
    """Custom functions were called differently while tracing than while recording."""


class CustomFunctionError(JitError, TypeError):
    """The forward function of a custom function broke its contract."""


class GradientError(JitError, ValueError):
    """The gradient function of a custom function broke its contract."""


class GuardError(JitError, RuntimeError):
    """A value that traced Python code branched on changed (``on_guard_failure="error"``)."""


class TraceError(JitError, RuntimeError):
    """The tracing engine rejected the function; the message says why and how to fix it."""


class TorchVersionError(JitError, RuntimeError):
    """The installed torch lacks an API phi_torch_jit needs (see ``_compat.PRIVATE_APIS``)."""


class JitWarning(UserWarning):
    """Something works, but probably not the way the user expects."""


class RunEagerly(Exception):
    """Internal signal, never seen by users: this specialization cannot be compiled
    faithfully and runs the Python function instead (logged once, shown by explain())."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WalkFailed(RunEagerly):
    """Internal signal: the static walk of the state a step reads raised (an object of the
    user's whose attribute lookups raise, such as a ``__getattribute__`` answering from a
    table): that signature runs eagerly, warned, never a crash (probe 46). ``before_record``:
    raised before the record pass ran the function (the caller runs it)."""

    def __init__(self, reason: str, before_record: bool = False) -> None:
        super().__init__(reason)
        self.before_record = before_record


class NotNow(Exception):
    """Internal signal, never seen by users: the engine cannot compile now without making the
    caller wait (engine "auto" while its compile thread traces); this call's record pass is its
    result, nothing is cached, and the next call of the signature tries again."""


class ValueNotCaptured(RunEagerly):
    """Internal signal: graph capture met a tensor read as a Python value that no value guard
    intercepted (value guards off, or a conversion inside a torch op: ``torch.ones(n)``)."""


def describe_function(fn: Any, name: str | None = None) -> str:
    """Name a user callable as ``name (file:line)`` for error messages.

    ``name`` overrides the callable's qualified name. Falls back to the bare
    name when the source is unknown (builtins, callables defined in a REPL).
    """
    target = fn
    name = name or _name_of(fn)
    if name is None:  # a callable object such as an nn.Module
        name = type(fn).__qualname__
        target = getattr(type(fn), "forward", None) or type(fn).__call__
    try:
        target = inspect.unwrap(target)
    except Exception:  # a __wrapped__ that raises, or a cycle of them
        pass
    code = _code_of(target)
    if code is not None:  # no source reading: inspect parses a whole module to find a class
        return f"{name} ({code.co_filename}:{code.co_firstlineno})"
    try:
        file = inspect.getsourcefile(target)
        _, line = inspect.getsourcelines(target)
    except (TypeError, OSError):
        return str(name)
    return f"{name} ({file}:{line})"


def _name_of(fn: Any) -> str | None:
    """``fn``'s qualified or plain name, or None: a callable object whose ``__getattr__``
    raises something else than AttributeError for these names (a config backed by a dict:
    ``KeyError``, probe 50) has none."""
    for attribute in ("__qualname__", "__name__"):
        try:
            name = getattr(fn, attribute, None)
        except Exception:  # the user's __getattr__: not a name
            continue
        if isinstance(name, str) and name:
            return name
    return None


def _code_of(target: Any) -> Any:
    """The code object that locates ``target``: its own, or for a class the first of its
    ``forward``, ``__call__``, ``__init__`` defined in Python."""
    if isinstance(target, type):
        for attr in ("forward", "__call__", "__init__"):
            method: Any = target.__dict__.get(attr)
            method = getattr(method, "__func__", method)
            if hasattr(method, "__code__"):
                return method.__code__
        return None
    return getattr(target, "__code__", None)


_INTERPRETER = "The following operation failed in the TorchScript interpreter."


def describe_error(error: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters), for logs and explain();
    for an error of the TorchScript interpreter, what failed and where (:func:`_interpreted`)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if lines[0].startswith(_INTERPRETER):
        return f"{type(error).__name__}: {_interpreted(lines)}"
    return f"{type(error).__name__}: {lines[0].strip()[:200]}"


def _interpreted(lines: list[str]) -> str:
    """The TorchScript interpreter's message: the error it reports (its last line, which is
    only ``builtins.RuntimeError:`` when the scripted code raised without a message), then its
    traceback's innermost ``File ..., line ...`` and the operation marked ``<--- HERE``."""
    files = [line.strip() for line in lines if line.strip().startswith("File ")]
    mark = next((i for i, line in enumerate(lines) if "<--- HERE" in line), None)
    operation = lines[mark - 1].strip() if mark else ""
    kind, colon, text = lines[-1].strip().partition(":")
    if not colon or " " in kind:  # not "SomeError: message"
        kind, text = "", lines[-1]
    message = text.strip()[:200] or f"{kind} raised without a message"
    where = f" [{files[-1]}: {operation}]" if files else ""
    return f"{message}{where}"


P = ParamSpec("P")
T = TypeVar("T")


def eager_if_it_raises(walk: Callable[P, T]) -> Callable[P, T]:
    """``walk`` (the static walk of the state a step reads), raising :class:`WalkFailed` where
    it raised: code of the user's that an attribute lookup ran (a ``__getattribute__``
    answering from a table); the step then runs eagerly, warned."""

    @functools.wraps(walk)
    def walked(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return walk(*args, **kwargs)
        except (RunEagerly, JitError):
            raise
        except Exception as error:
            why = f"the walk of the state it reads raised {describe_error(error)}"
            raise WalkFailed(f"{why} (an object of yours whose lookups raise?)") from error

    return walked
