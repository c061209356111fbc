"""The one exception root of the sidecar.

Every error that reaches an operator says what to do about it. Errors about a single record
(a bad header, a policy violation) are not raised to the top: they become dead-letter records.
"""


class SidecarError(Exception):
    """Root of every error the sidecar raises on purpose."""


class ConfigError(SidecarError):
    """A setting or a policy file is wrong; the message names it and what was expected."""


class BrokerError(SidecarError):
    """The Kafka cluster (embedded or external) could not be started or reached."""


class ConsumerFailed(BrokerError):
    """The group's consumer failed for good (librdkafka's fatal error): its handle is dead."""


class StorageError(SidecarError):
    """The state dir cannot be used; the message says whether to wait, repair or move it."""


class RejectedRecord(SidecarError):
    """A record that must go to a dead-letter topic rather than be delivered."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Refused(SidecarError):
    """A cancel or reschedule answered `rejected` with a code on the outcomes topic (not dead-lettered)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InvalidDelayHeader(RejectedRecord):
    def __init__(self, message: str) -> None:
        super().__init__("INVALID_DELAY_HEADER", message)


class Fenced(BrokerError):
    """Another producer took this instance's transactional.id: this engine must not write again."""
