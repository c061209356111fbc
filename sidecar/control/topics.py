"""Which control topic serves which inbound topic, and which control topics this member reads.

A topic's policy may name its own control topic (`control_topic`, topic > namespace > the
sidecar's `--control-topic`), so that Kafka ACLs on that topic decide who may nack, cancel or
reschedule its messages. A command that arrives on another control topic is refused with
WRONG_CONTROL_TOPIC: otherwise Write on the default control topic would still reach every topic.

The set of control topics read only grows while the process lives. A control topic that no policy
names any more still holds accepted nacks until they are redelivered, so it stays read; after a
restart, the group's commits on it keep it read while they hold a pending nack (`retired`).
"""

from collections.abc import Iterable, Mapping

from sidecar.control.cancels import OUTCOMES_SUFFIX, WRONG_CONTROL_TOPIC
from sidecar.errors import Refused
from sidecar.partitions.metadata import CommitMetadata
from sidecar.policy.model import PolicySet

DEAD_LETTER_SUFFIX = ".dlt"


def side_topics(control_topic: str) -> tuple[str, str]:
    """The dead-letter and outcomes topics that go with a control topic."""
    return control_topic + DEAD_LETTER_SUFFIX, control_topic + OUTCOMES_SUFFIX


class ControlTopics:
    def __init__(self, default: str) -> None:
        self.default = default
        self._serving: dict[str, str] = {}
        """Inbound topic -> the control topic its commands must arrive on."""
        self._read: set[str] = {default}

    def update(self, policies: PolicySet) -> list[str]:
        """Take a new generation of policies; returns the control topics it adds to the ones read."""
        self._serving = {name: route.control_topic or self.default for name, route in policies.topics.items()}
        return self.add(self._serving.values())

    def add(self, topics: Iterable[str]) -> list[str]:
        new = sorted(set(topics) - self._read)
        self._read.update(new)
        return new

    @property
    def read(self) -> frozenset[str]:
        return frozenset(self._read)

    def with_side_topics(self) -> list[str]:
        """Every control topic read, with its dead-letter and outcomes topics: the topics to create."""
        return [name for control in sorted(self._read) for name in (control, *side_topics(control))]

    def is_control(self, topic: str) -> bool:
        return topic in self._read

    def serving(self, topic: str) -> str:
        """The control topic of an inbound topic (the default one for a topic the policies do not name)."""
        return self._serving.get(topic, self.default)

    def check(self, control_topic: str, topic: str) -> None:
        """Refused(WRONG_CONTROL_TOPIC): the command is about a served topic whose control topic is another."""
        wanted = self._serving.get(topic)
        if wanted is not None and wanted != control_topic:
            raise Refused(
                WRONG_CONTROL_TOPIC,
                f"commands for {topic!r} go to its control topic {wanted!r}, not to {control_topic!r}",
            )


def retired(
    commits: Mapping[tuple[str, int], tuple[int, str | None]], existing: Iterable[str], read: Iterable[str]
) -> list[str]:
    """Control topics no policy names any more whose commits still hold pending nacks: read until they are out."""
    skip, exists = set(read), set(existing)
    found = set()
    for (topic, _), (offset, raw) in commits.items():
        if topic in skip or topic not in exists:
            continue
        metadata = CommitMetadata.decode(raw)
        if metadata.control and metadata.earliest is not None and metadata.earliest < offset:
            found.add(topic)
    return sorted(found)
