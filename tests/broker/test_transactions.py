"""What exactly-once will rest on, checked on the broker the tests run against (issue 14's first step)."""

import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer


def test_a_second_producer_with_the_same_transactional_id_fences_the_first(
    kafka: str, topic_factory: Callable[..., str]
) -> None:
    topic, transactional_id = topic_factory("fence"), f"tx-{uuid.uuid4().hex[:8]}"
    zombie = Producer({"bootstrap.servers": kafka, "transactional.id": transactional_id})
    zombie.init_transactions(30)
    zombie.begin_transaction()
    zombie.produce(topic, b"from the zombie")
    successor = Producer({"bootstrap.servers": kafka, "transactional.id": transactional_id})
    successor.init_transactions(30)
    with pytest.raises(KafkaException) as failed:
        zombie.commit_transaction(30)
    assert failed.value.args[0].code() == KafkaError._FENCED
