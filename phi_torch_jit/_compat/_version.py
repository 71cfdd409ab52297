"""What depends on the torch release, beside the private APIs: the torch versions the suite
is tested on (:data:`TESTED_TORCH`; ``make test`` runs the suite on each, and
``tests/test_compat.py`` checks them against ``requirements/`` and pyproject.toml), and the
texts of torch's messages that phi_torch_jit matches."""

from __future__ import annotations

TESTED_TORCH = ("2.11.0", "2.13.0", "2.15.0")
"""torch releases the whole test suite runs on: one ``requirements/torch-<version>.txt`` each
(the Makefile's ``TORCH_VERSIONS``)."""


TORCHSCRIPT_NOTICE = r"`torch\.jit\.\w+` is (deprecated|not supported)"
"""What torch's TorchScript deprecation notices start with (2.13: DeprecationWarning;
2.15: FutureWarning; on Python 3.14: '... is not supported in Python 3.14+ and may break')."""


VALUE_OUT_OF_GRAPH = "trying to get value out of a tracing tensor"
"""Part of the error make_fx raises when a traced tensor's value is read (``.item()``, an op
that needs a number); torch 2.11-2.15."""
