"""What `--help` shows for each flag: what a value looks like (HOST:PORT, PATH, MS) and its real default.

pydantic-settings writes the Python type as the metavar (`{str,null}`, `list[str]`) and `null` or
an empty string as the default of an optional flag. Both mean nothing to an operator. The flags
are built by pydantic-settings from the settings models; this module only rewrites their help, in
the argparse call that adds each flag, so every command (including `audit`, whose settings live in
spark/) gets the same words for the same flag.
"""

import argparse
import re
from typing import Any

# By flag name: the same flag means the same thing in every command.
METAVARS: dict[str, str] = {
    "bootstrap_servers": "HOST:PORT[,HOST:PORT...]",
    "sasl_mechanism": "MECHANISM",
    "sasl_username": "USER",
    "sasl_password": "PASSWORD",
    "ssl_key_password": "PASSWORD",
    "ssl_ca_location": "PATH",
    "policies": "PATH",
    "file": "PATH",
    "state_dir": "DIR",
    "data_dir": "DIR",
    "output_dir": "DIR",
    "port": "PORT",
    "broker_port": "PORT",
    "broker_kind": "KIND",
    "nodes": "N",
    "replication_factor": "N",
    "metrics_port": "PORT",
    "host": "HOST",
    "metrics_host": "HOST",
    "group_id": "GROUP",
    "instance_id": "ID",
    "topic": "TOPIC",
    "namespace": "NAMESPACE",
    "control_topic": "TOPIC",
    "state_topic": "TOPIC",
    "control_dead_letter_topic": "TOPIC",
    "outcomes_topic": "TOPIC",
    "max_delay": "DURATION",
    "fixed_delay": "DURATION",
    "by_key": "none|replace",
    "topics": "TOPIC[,TOPIC...]",
    "subscriptions": "NAME[,NAME...]",
    "routes": "TOPIC/SUBSCRIPTION=OUTBOUND[,...]",
    "dead_letter_topics": "TOPIC=DLT[,...]",
    "starting_offsets": "earliest|JSON",
    "ending_offsets": "latest|JSON",
    "from_time": "TIME",
    "to_time": "TIME",
    "master": "URL",
    "connector_repository": "URL",
    "driver_memory": "SIZE",
    "payload_cache_bytes": "BYTES",
}

# By flag name, for flags without a value of their own: what happens when they are not given.
UNSET: dict[str, str] = {
    "bootstrap_servers": "none",
    "replication_factor": "the broker's default.replication.factor, at least min(3, brokers)",
    "security_protocol": "librdkafka's, PLAINTEXT",
    "sasl_mechanism": "librdkafka's, GSSAPI",
    "driver_memory": "Spark's",
}

_DEFAULT = re.compile(r" ?\((default|default factory): ([^()]*)\)$")
_SAYS_DEFAULT = re.compile(r"\bdefault[ :]|\(required\)", re.IGNORECASE)
_PYTHON_TYPES = {"str", "int", "float", "Path", "SecretStr", "list[str]"}


def metavar_for(name: str, metavar: str | None) -> str | None:
    """The metavar to show: a word for the value, or the choices without `null`."""
    if metavar is None:
        return None
    if name in METAVARS:
        return METAVARS[name]
    bare = metavar.removesuffix(",null}").removeprefix("{") if metavar.endswith(",null}") else metavar
    if bare in _PYTHON_TYPES:
        if name.endswith("_ms"):
            return "MS"
        if bare in ("int", "float"):
            return "N"
        return name.upper()
    return bare  # choices, like {bucket,memory}


def help_for(name: str, text: str | None) -> str | None:
    """The help text with the default an operator can use, instead of `null`, `` or a factory's name."""
    if text is None or text == argparse.SUPPRESS:
        return text
    match = _DEFAULT.search(text)
    if match is None:
        return text
    kind, value = match.groups()
    described = text[: match.start()]
    if kind == "default" and value not in ("null", "", "[]"):
        return text
    if _SAYS_DEFAULT.search(described):  # the description already says it in words
        return described
    return f"{described} (default: {UNSET.get(name, 'not set')})"


def add_argument(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> argparse.Action:
    """argparse's add_argument, with the metavar and default rewritten for an operator."""
    dest = kwargs.get("dest") or names[0]
    name = str(dest).rsplit(".", 1)[-1]
    if "metavar" in kwargs and names and names[0].startswith("-"):
        kwargs["metavar"] = metavar_for(name, kwargs["metavar"])
    if "help" in kwargs:
        kwargs["help"] = help_for(name, kwargs["help"])
    return parser.add_argument(*names, **kwargs)
