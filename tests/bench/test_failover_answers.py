"""The failover bench's questions to the cluster are asked again while it does not answer: beside
a busy neighbour a node stalled for 26 s and more, and a strike that asked once failed."""

import pytest
from confluent_kafka import KafkaError, KafkaException

from bench.failover import answered


def test_a_question_is_asked_again_until_the_cluster_answers() -> None:
    asked: list[int] = []

    def ask() -> int:
        asked.append(1)
        if len(asked) < 3:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return 7

    assert answered(ask, "a leader", timeout_s=30) == 7
    assert len(asked) == 3


def test_no_answer_by_the_deadline_names_the_question_and_the_last_error() -> None:
    def ask() -> int:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    with pytest.raises(RuntimeError, match=r"no answer in 1 s about the leader of t/0: .*_TIMED_OUT"):
        answered(ask, "the leader of t/0", timeout_s=1)
