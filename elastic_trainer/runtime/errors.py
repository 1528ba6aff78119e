"""The project's error classes that no restart can fix, apart from how failures are reported.

:mod:`elastic_trainer.runtime.settings` raises them while it parses the environment, and
:mod:`elastic_trainer.runtime.failures` (which reads its variable names from the settings)
classifies and reports them; keeping them here keeps that import one-way. Import them from
either module.
"""

from __future__ import annotations


class DeterministicError(Exception):
    """Base of errors no restart can fix (configuration, checkpoint directory, ...).

    The runtime's own ones subclass it; user code may raise it (or a subclass) too.
    """


class ConfigError(DeterministicError, ValueError):
    """A setting is invalid; the message names it. A restart cannot fix it."""


class UserError(ConfigError):
    """A mistake at a command line (``elastic-trainer``'s or the doctor's): one line on stderr, exit
    status 2, no traceback."""
