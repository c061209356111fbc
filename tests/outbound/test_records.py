from sidecar.outbound.records import dead_letter_headers, outbound_headers


def test_outbound_headers_keep_the_original_and_add_the_message_id() -> None:
    headers = outbound_headers([("a", b"1"), ("b", None)], "orders", 2, 41, 1234, redelivery_count=3)
    assert headers == [
        ("a", b"1"),
        ("b", b""),
        ("delay-origin-topic", b"orders"),
        ("delay-origin-partition", b"2"),
        ("delay-origin-offset", b"41"),
        ("delay-deliver-at", b"1234"),
        ("delay-redelivery-count", b"3"),
    ]


def test_dead_letter_headers_carry_code_message_and_origin() -> None:
    headers = dict(dead_letter_headers(None, "orders", 0, 7, "INVALID_DELAY_HEADER", "bad"))
    assert headers == {
        "delay-error-code": b"INVALID_DELAY_HEADER",
        "delay-error-message": b"bad",
        "delay-origin-topic": b"orders",
        "delay-origin-partition": b"0",
        "delay-origin-offset": b"7",
    }
