"""The embedded broker: noida-db's Kafka-compatible server as a child process.

It exists so a newcomer, CI and the tests get a real broker on a machine without Docker. Its data
lives under the state dir, so topics and committed offsets survive a restart of the sidecar.
"""

import logging
import os
import signal
import socket
import subprocess
import time
from importlib.resources import files
from pathlib import Path

from sidecar.broker.base import BrokerLauncher, wait_for_metadata
from sidecar.errors import BrokerError

logger = logging.getLogger(__name__)

# noida-db persists its log on shutdown; give it time to finish writing before a SIGKILL.
STOP_GRACE_S = 15.0
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def noida_binary() -> Path:
    binary = Path(str(files("noida_db").joinpath("noida-db")))
    if not binary.is_file():
        raise BrokerError(f"noida-db binary missing at {binary}; reinstall with: .venv/bin/pip install noida-db")
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    return binary


class EmbeddedBroker(BrokerLauncher):
    def __init__(self, data_dir: Path, port: int = 9092, host: str = "127.0.0.1") -> None:
        self.data_dir = data_dir
        self.port = port
        self.host = host
        self.bootstrap_servers = f"{host}:{port}"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.data_dir / "broker.log"
        command = [
            str(noida_binary()),
            "start",
            "--data-dir",
            str(self.data_dir),
            "--only",
            "kafka",
            "--host",
            self.host,
            "--kafka-port",
            str(self.port),
        ]
        with log_path.open("ab") as log:
            # A session of its own: Ctrl-C in a terminal reaches the sidecar, which stops the broker
            # in order, instead of killing both at once.
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        logger.info(
            "broker starting pid=%d bootstrap=%s data_dir=%s", self._process.pid, self.bootstrap_servers, self.data_dir
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info("broker ready bootstrap=%s", self.bootstrap_servers)
        return self.bootstrap_servers

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        process = self._process
        assert process is not None
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = (self.data_dir / "broker.log").read_text(errors="replace")[-2000:]
                raise BrokerError(
                    f"the embedded broker exited with code {process.returncode} before it was ready; is port "
                    f"{self.port} already in use? Pick another with --port. Its log ends:\n{tail}"
                )
            try:
                wait_for_metadata(self.bootstrap_servers, timeout_s=1.0)
                return
            except BrokerError:
                continue
        raise BrokerError(
            f"the embedded broker did not answer within {START_TIMEOUT_S:.0f}s; see {self.data_dir / 'broker.log'}"
        )

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            logger.warning("broker did not stop in %.0fs; killing pid=%d", STOP_GRACE_S, process.pid)
            process.kill()
            process.wait()
        logger.info("broker stopped bootstrap=%s", self.bootstrap_servers)
