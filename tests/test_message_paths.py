"""GET /messages/... as the metrics port parses it, and `messages show` as it prints an answer (no broker)."""

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sidecar.http import StatusServer
from sidecar.messages_command import format_answer

Asked = tuple[str, int, int | bytes, str | None]


@pytest.fixture
def server() -> Iterator[tuple[int, list[Asked]]]:
    asked: list[Asked] = []

    def message(topic: str, partition: int, at: int | bytes, scope: str | None) -> tuple[int, dict[str, Any]]:
        asked.append((topic, partition, at, scope))
        return 200, {"ok": True}

    status = StatusServer("127.0.0.1", 0, CollectorRegistry(), lambda: (True, [], {}), lambda _: None, message)
    status.start()
    yield status.port, asked
    status.stop()


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_message_is_asked_by_offset_or_by_key(server: tuple[int, list[Asked]]) -> None:
    port, asked = server
    assert get(port, "/messages/orders/3/1042")[0] == 200
    assert get(port, "/messages/orders/3/1042?scope=member")[0] == 200
    assert get(port, "/messages/orders/3?key=" + urllib.parse.quote("user/7 é"))[0] == 200
    assert get(port, "/messages/orders/3?" + urllib.parse.urlencode({"key_base64": "/wBrZXk="}))[0] == 200
    assert asked == [
        ("orders", 3, 1042, None),
        ("orders", 3, 1042, "member"),
        ("orders", 3, "user/7 é".encode(), None),
        ("orders", 3, b"\xff\x00key", None),
    ]


@pytest.mark.parametrize(
    ("path", "status", "error"),
    [
        ("/messages/orders/3?key_base64=%21%21", 400, "'key_base64' is not base64"),
        ("/messages/orders/3?key=", 400, "'key' must be a non-empty string"),
        ("/messages/orders/3?key=a&key_base64=YQ%3D%3D", 400, "not both"),
        ("/messages/orders/3?key=" + "k" * 4097, 400, "longer than 4096 bytes"),
        ("/messages/orders/3/1042?key=a", 404, "?key=KEY"),
        ("/messages/orders/x?key=a", 404, "?key=KEY"),
        ("/messages/orders/3", 404, "{offset}"),
    ],
)
def test_a_bad_key_or_path_is_refused_with_what_to_ask(
    server: tuple[int, list[Asked]], path: str, status: int, error: str
) -> None:
    port, asked = server
    got = get(port, path)
    assert got[0] == status and error in got[1]["error"], got
    assert asked == []


def test_an_answer_by_key_prints_the_key_and_what_replaced_an_older_record() -> None:
    subscriptions = {"billing": {"state": "tombstone"}, "audit": {"state": "delivered", "deliver_at": 0}}
    by_key = {"topic": "t", "partition": 0, "offset": 3, "key": "b", "state": "mixed", "subscriptions": subscriptions}
    assert format_answer(by_key).splitlines() == [
        "t/0/3: mixed",
        "  key: b",
        "  audit: delivered 1970-01-01T00:00:00.000Z",
        "  billing: tombstone -",
    ]
    unknown = {"topic": "t", "partition": 1, "key_base64": "/wA=", "state": "unknown", "reason": "no record"}
    assert format_answer(unknown).splitlines() == ["t/1: unknown", "  key_base64: /wA=", "  reason: no record"]
    replaced = {"topic": "t", "partition": 0, "offset": 0, "state": "replaced",
                "subscriptions": {"billing": {"state": "replaced", "newest_offset": 1}}}  # fmt: skip
    assert format_answer(replaced).splitlines() == ["t/0/0: replaced", "  billing: replaced (by offset 1) -"]
