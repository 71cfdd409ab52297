"""A corpus of third-party programs run through phi_torch_jit against eager (docs/corpus.md)."""

from __future__ import annotations

from .harness import Program


def all_programs() -> list[Program]:
    """Every corpus program, in table order (builders import their library lazily)."""
    from . import programs_ml, programs_models, programs_ode, programs_torch

    return [
        *programs_torch.PROGRAMS,
        *programs_ode.PROGRAMS,
        *programs_models.PROGRAMS,
        *programs_ml.PROGRAMS,
    ]
