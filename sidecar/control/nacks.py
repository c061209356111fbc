"""Which pending nack is the one in force: for one subscription and message, the latest command wins.

A nack is indexed by the position of its command in the control topic, in the same kind of tracker
as producer delays, so the control log itself is the nack's write-ahead log: a control offset is
never committed past the earliest nack still pending, and a restart reads the commands again from
there, which rebuilds this table too.
"""

from sidecar.control.commands import NackCommand

ControlPosition = tuple[int, int]  # (control partition, control offset)


class LatestNacks:
    def __init__(self) -> None:
        self._latest: dict[tuple[str, str, int, int], ControlPosition] = {}

    def accept(self, command: NackCommand, position: ControlPosition) -> None:
        """Record a command as the one in force for its message, unless a later command already is.

        Commands for one message share its key, hence one control partition, so their offsets
        give their order; an acceptance written twice (a crash before the commit) changes nothing.
        """
        current = self._latest.get(command.message_key)
        if current is None or current[0] != position[0] or current[1] < position[1]:
            self._latest[command.message_key] = position

    def claim(self, command: NackCommand, position: ControlPosition) -> bool:
        """True when this due command is still the latest for its message; it is then settled."""
        if self._latest.get(command.message_key) != position:
            return False
        del self._latest[command.message_key]
        return True

    def forget_partition(self, partition: int) -> None:
        """A control partition went to another sidecar: its commands are not ours to settle."""
        self._latest = {k: v for k, v in self._latest.items() if v[0] != partition}

    def __len__(self) -> int:
        return len(self._latest)
