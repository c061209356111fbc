"""The suite's wait helper: what it asks again, and what fails at once."""

import pytest

from tests.kafka_helpers import MetricMissing, wait_for


def test_an_assertion_in_the_condition_fails_the_wait_at_once() -> None:
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise AssertionError("a claim the test makes")

    with pytest.raises(AssertionError, match="a claim the test makes"):
        wait_for(broken, 30, "a broken condition")
    assert len(calls) == 1  # not asked again until the deadline


def test_a_metric_not_exported_yet_is_asked_again_until_it_is() -> None:
    answers = iter([MetricMissing("not yet"), MetricMissing("not yet"), True])

    def condition() -> bool:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    wait_for(condition, 30, "a metric")
    with pytest.raises(AssertionError, match="timed out waiting for a metric that never comes"):
        wait_for(lambda: (_ for _ in ()).throw(MetricMissing("never")), 0.5, "a metric that never comes")
