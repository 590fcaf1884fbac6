"""Errors of the training tools that a user can fix (shown without a traceback by the CLI)."""

from __future__ import annotations

from ..errors import DFlashError


class TrainingError(DFlashError):
    """A training setting, data directory or work directory that cannot be used as it is."""
