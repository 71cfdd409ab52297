"""A user's configuration module, read as ``read_settings.GRAVITY`` by tests/test_held_state.py."""

GRAVITY = 9.81
TABLE = {"drag": [0.1, 0.2]}


def scaled(x):  # type: ignore[no-untyped-def]
    """A function of the user's module that reads the module's globals."""
    return x * GRAVITY


class Limits:
    """A class of the user's module holding constants (``read_settings.Limits.RATE``)."""

    RATE = 1.0
