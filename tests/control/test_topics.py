"""Which control topic serves which topic, and which are read (control/topics.py). Pure."""

from pathlib import Path

import pytest

from sidecar.control.topics import WRONG_CONTROL_TOPIC, ControlTopics, retired
from sidecar.errors import Refused
from sidecar.partitions.metadata import CommitMetadata
from sidecar.policy import PolicySet, load_policies


def policies(tmp_path: Path, text: str) -> PolicySet:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return load_policies(path)


def test_a_command_is_taken_only_on_the_control_topic_of_its_topic(tmp_path: Path) -> None:
    controls = ControlTopics("ctl")
    added = controls.update(policies(tmp_path, "topics:\n  a:\n    control_topic: a.ctl\n  b: {}\n"))
    assert added == ["a.ctl"] and controls.read == {"ctl", "a.ctl"}
    assert controls.with_side_topics() == ["a.ctl", "a.ctl.dlt", "a.ctl.outcomes", "ctl", "ctl.dlt", "ctl.outcomes"]
    controls.check("a.ctl", "a")
    controls.check("ctl", "b")
    controls.check("a.ctl", "unknown")  # answered UNKNOWN_TOPIC further on, not here
    for control, topic in (("ctl", "a"), ("a.ctl", "b")):
        with pytest.raises(Refused) as refused:
            controls.check(control, topic)
        assert refused.value.code == WRONG_CONTROL_TOPIC and repr(control) in refused.value.message


def test_a_control_topic_the_policies_drop_stays_read_by_this_process(tmp_path: Path) -> None:
    controls = ControlTopics("ctl")
    controls.update(policies(tmp_path, "topics:\n  a:\n    control_topic: a.ctl\n"))
    assert controls.update(policies(tmp_path, "topics:\n  a: {}\n")) == []
    assert controls.is_control("a.ctl") and controls.serving("a") == "ctl"


def test_a_restart_keeps_reading_a_dropped_control_topic_while_its_commits_hold_pending_nacks() -> None:
    pending = CommitMetadata(earliest=4, control=True).encode()
    settled = CommitMetadata(earliest=9, control=True).encode()
    inbound = CommitMetadata(earliest=4).encode()
    commits = {
        ("old", 0): (9, pending),
        ("old", 1): (9, settled),
        ("done", 0): (9, settled),
        ("gone", 0): (9, pending),
        ("topic", 0): (9, inbound),
        ("ctl", 0): (9, pending),
    }
    assert retired(commits, ["old", "done", "topic", "ctl"], ["ctl"]) == ["old"]
