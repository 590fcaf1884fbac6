"""Errors raised at the project's boundaries.

Every error a user can trigger (a bad prompt, a bad setting, a bad file) is a ``ValueError``
subclass whose message says what was wrong and what is allowed, so the CLI, the Python API and
the UI can show it as is.
"""

from __future__ import annotations


class DFlashError(ValueError):
    """Base class of the errors a user can fix."""


class RegistryError(DFlashError):
    """``models.toml`` is malformed, or names a pair that does not exist."""


class ModelLoadError(DFlashError):
    """A target or drafter could not be found or loaded."""


class DrafterMismatchError(DFlashError):
    """A drafter was built for another target (hidden size, layers, vocabulary)."""


class SettingsError(DFlashError):
    """A generation setting is outside what the engine supports."""


class PromptError(DFlashError):
    """A prompt is empty, too long for the target's context, or otherwise unusable."""


class DeviceUnavailableError(DFlashError):
    """A pair needs a device (e.g. CUDA) that this machine does not have."""
