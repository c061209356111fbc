"""Where an OutcomeReader starts: the outcomes topic's end, asked again while the topic's partitions
have no leader yet. Without a broker: the answers are the ones a loaded broker gave."""

from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from sidecar.client_cancel import topic_ends

TOPIC = "delay-sidecar.control.outcomes"


@dataclass
class Topic:
    partitions: dict[int, object]
    error: KafkaError | None = None


@dataclass
class Metadata:
    topics: dict[str, Topic]


@dataclass
class Consumer:
    """Answers the metadata and then each watermark query with the next of `answers` (an error
    code raises it); a partition's end is 10 + the partition."""

    metadata: list[Topic | None]
    answers: list[int | None] = field(default_factory=list)
    asked: int = 0

    def list_topics(self, topic: str, timeout: float) -> Metadata:
        found = self.metadata.pop(0) if len(self.metadata) > 1 else self.metadata[0]
        return Metadata({} if found is None else {topic: found})

    def get_watermark_offsets(self, partition: TopicPartition, timeout: float, cached: bool) -> tuple[int, int]:
        self.asked += 1
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            raise KafkaException(KafkaError(answer))
        return 0, 10 + partition.partition


def ends(consumer: Consumer, timeout_s: float = 30.0) -> list[tuple[int, int]]:
    return [(p.partition, p.offset) for p in topic_ends(consumer, TOPIC, timeout_s)]  # type: ignore[arg-type]


def test_a_topic_whose_partitions_have_no_leader_yet_is_asked_again() -> None:
    """A clean-clone CI run: a reader opened as the sidecar created the topic was answered
    NOT_LEADER_FOR_PARTITION, and the reader failed."""
    not_leader, no_leader = KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE
    consumer = Consumer(
        [Topic({0: None, 1: None}, KafkaError(no_leader)), Topic({0: None, 1: None})], [not_leader, None, not_leader]
    )
    assert ends(consumer) == [(0, 10), (1, 11)]
    assert consumer.asked == 4  # each partition asked again on its own


@pytest.mark.parametrize("found", [None, Topic({}, KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)), Topic({})])
def test_a_topic_that_does_not_exist_is_an_error_at_once(found: Topic | None) -> None:
    with pytest.raises(KafkaException, match="does not exist yet; start the sidecar first"):
        ends(Consumer([found]))


def test_other_errors_are_raised_at_once_and_a_leader_that_never_comes_after_the_timeout() -> None:
    denied = Consumer([Topic({0: None})], [KafkaError.TOPIC_AUTHORIZATION_FAILED])
    with pytest.raises(KafkaException, match="TOPIC_AUTHORIZATION_FAILED"):
        ends(denied)
    assert denied.asked == 1
    never = Consumer([Topic({0: None})], [KafkaError.NOT_LEADER_FOR_PARTITION] * 1_000)
    with pytest.raises(KafkaException, match="NOT_LEADER_FOR_PARTITION"):
        ends(never, timeout_s=0.5)
    assert 1 < never.asked < 1_000
