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


class TrainingDiverged(DsparkError):
    """A loss or gradient norm that is not finite: the run stops before a weight moves."""


class CheckpointError(DsparkError):
    """A run's checkpoint or metric log that cannot be written, or a checkpoint unsafe or damaged to read."""


def repair_command(store: str, data: str | None = None, model: str | None = None) -> str:
    """The command that re-extracts exactly the damaged and missing samples of a store."""
    return f"`dspark store repair {store} --data {data or 'PREPARED'} --model {model or 'VERIFIER'}`"


class DamagedSample(StoreError):
    """A sample the store indexes but cannot give back intact (checksum mismatch, missing or
    undecodable chunk). Readers decide: skip it (`--on-damaged skip`) or stop."""

    def __init__(self, sample_id: int, location: str, reason: str):
        self.sample_id, self.location, self.reason = sample_id, location, reason
        super().__init__(f"sample {sample_id} in {location} is damaged ({reason})",
                         f"re-extract the damaged samples: {repair_command(location)}")
