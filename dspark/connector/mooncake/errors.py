"""What can go wrong with Mooncake, as named errors carrying what to do."""

from dspark.core.errors import DsparkError


class MooncakeError(DsparkError):
    """Anything the live store did wrong."""


class MooncakeUnavailable(MooncakeError):
    """The master cannot be reached (down, wrong address, network)."""


class MooncakeFull(MooncakeError):
    """No space left in the mounted segments."""


class ObjectGone(MooncakeError):
    """An object that existed is no longer there (lease expired and evicted, or its segment left)."""


class CorruptObject(MooncakeError):
    """An object whose size, layout or checksum does not match its manifest."""


class ProducerFailed(MooncakeError):
    """The producer published an error marker for this sample."""
