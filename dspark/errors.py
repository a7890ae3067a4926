"""User-facing errors.

Every mistake a user can make raises a :class:`DsparkError` that says what is
wrong and how to fix it; the CLI prints it as one line and exits non-zero.
"""


class DsparkError(Exception):
    """A user-facing failure: ``str(err)`` is the one line the CLI prints."""

    exit_code = 2

    def __init__(self, what: str, fix: str | None = None):
        self.what, self.fix = what, fix
        super().__init__(f"{what} (fix: {fix})" if fix else what)


class InputError(DsparkError):
    """Bad user input: data files, flags, model folders."""


class StoreError(DsparkError):
    """A hidden-state store that is missing, damaged or does not match."""


class StoreMismatch(StoreError):
    """A store written for another verifier, layer set, data set or format."""
