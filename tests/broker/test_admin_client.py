"""The admin client behind the engine's reachability probe is made again when it goes unanswered."""

from typing import Any

import pytest
from confluent_kafka import KafkaException

from sidecar.broker import admin
from sidecar.broker.admin import FRESH_CLIENT_AFTER_S, TopicAdmin


class StuckClient:
    """An AdminClient whose first instance never answers metadata, as librdkafka's did after a restart."""

    made: list["StuckClient"] = []

    def __init__(self, config: dict[str, Any], logger: Any = None) -> None:
        self.stuck = not StuckClient.made
        StuckClient.made.append(self)

    def list_topics(self, timeout: float) -> object:
        if self.stuck:
            raise KafkaException("Failed while waiting for controller: Local: Timed out")
        return object()


def test_an_unanswered_client_is_made_again_after_the_wait_and_the_new_one_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1_000.0]
    monkeypatch.setattr(admin, "AdminClient", StuckClient)
    monkeypatch.setattr(admin.time, "monotonic", lambda: now[0])
    StuckClient.made = []
    topics = TopicAdmin({"bootstrap.servers": "127.0.0.1:1"}, 1)
    assert not topics.reachable()
    now[0] += FRESH_CLIENT_AFTER_S - 0.5
    assert not topics.reachable()
    assert len(StuckClient.made) == 1  # not before the wait
    now[0] += 0.5
    assert not topics.reachable()  # this probe's answer was the old client's
    assert len(StuckClient.made) == 2
    assert topics.reachable()
    assert len(StuckClient.made) == 2
