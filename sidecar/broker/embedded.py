"""The embedded broker: noida-db's Kafka-compatible server as a child process.

It exists so a newcomer, CI and the tests get a real broker on a machine without Docker. Its data
lives under the state dir, so topics and committed offsets survive a restart of the sidecar. It is
for development and single-host trials, not production (see the README for what it loses).

Three rules, each from a fault seen in a trial:
- The broker dies with its parent (a parent-death signal), so a kill -9 of `run` or `broker` never
  leaves an orphan holding the port and the data dir.
- The broker that answers must be our own child: a port already in use is an error, not a broker.
- It is stopped through its own `stop kafka` command before it is signalled. On SIGTERM noida-db
  keeps serving, and acknowledging writes, while it saves its data, and those writes are lost; the
  stop command closes the Kafka listener and its connections first, then saves.
"""

import json
import logging
import os
import re
import signal
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files
from pathlib import Path

from sidecar.broker.base import BrokerLauncher, wait_for_metadata
from sidecar.broker.lifeline import die_with_parent
from sidecar.broker.ports import port_in_use
from sidecar.errors import BrokerError

logger = logging.getLogger(__name__)

# noida-db writes its whole data set to one JSON file when it stops: seconds for a large data dir
# (about 5 s for 100 MB on two cores). A SIGKILL during that write loses everything written since
# its last periodic save, so the grace period is long; a broker that needs it is logged.
STOP_GRACE_S = 120.0
# After the data is saved, the process itself exits within milliseconds.
EXIT_GRACE_S = 10.0
START_TIMEOUT_S = 30.0
_ALREADY_RUNNING = re.compile(r"noida-db is already running for .* \(pid (\d+)\)")
# A broker whose parent was killed gets SIGTERM and saves before it exits: wait for that much.
TAKEOVER_WAIT_S = 30.0
CONTROL_FILE = "noida.control.json"


def noida_version() -> str:
    try:
        return version("noida-db")
    except PackageNotFoundError:
        return "unknown"


def noida_binary() -> Path:
    binary = Path(str(files("noida_db").joinpath("noida-db")))
    if not binary.is_file():
        raise BrokerError(f"noida-db binary missing at {binary}; reinstall with: .venv/bin/pip install noida-db")
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    return binary


def _running_noida(pid: int) -> bool:
    """A noida-db with a thread still alive; the name check guards against a stale control file.

    Threads are looked at one by one: while a process exits, its leader thread can show as a zombie
    (with an empty command line) while the other threads still hold its files, the listener among them.
    """
    for stat, cmdline in _threads(pid) or ():
        state = stat.rsplit(b")", 1)[-1].split()[0]
        if state not in (b"Z", b"X") and b"noida-db" in cmdline:
            return True
    return False


def _threads(pid: int) -> list[tuple[bytes, bytes]] | None:
    """Each thread's /proc stat and command line (threads that went meanwhile left out); None when
    the process's threads cannot be listed (it is gone)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    found = []
    for task in tasks:
        try:
            found.append(((task / "stat").read_bytes(), (task / "cmdline").read_bytes()))
        except OSError:
            continue
    return found


def _control_pid(data_dir: Path) -> int | None:
    """The pid this data dir's control file names; None when there is no readable one."""
    try:
        return int(json.loads((data_dir / CONTROL_FILE).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def previous_broker(data_dir: Path) -> int | None:
    """The pid of a noida-db still serving this data dir, from its control file; None when there is none."""
    pid = _control_pid(data_dir)
    return pid if pid is not None and _running_noida(pid) else None


def _exiting_broker(data_dir: Path, port: int) -> bool:
    """A broker of this data dir on its way out still holds the port: the process its control file
    names still exists, in whatever state, or (the file already removed) the port's listener is held
    only by processes that have released their memory, as a process does in its exit before it closes
    its files. A broker whose parent was killed holds its port for a moment after its threads stop
    counting as running (seen in CI, under load, as "port already in use" right after a kill -9 of
    `broker`, once with the control file still there and once with it gone)."""
    pid = _control_pid(data_dir)
    if pid is not None:
        return Path(f"/proc/{pid}").exists()
    holders = _listener_holders(port)
    if not holders:
        # Nobody holds a listener now: it closed since the port was found in use (a broker's last
        # moment; the next look finds the port free: CI, under load, failed "port already in use"
        # here), unless it is another user's, whose files cannot be read here.
        return listening_inodes(port) == set()
    return all(_exiting(holder) for holder in holders)


def _exiting(pid: int) -> bool:
    """No thread of `pid` has a command line left: its memory is gone, its files not yet."""
    return not any(cmdline for _, cmdline in _threads(pid) or ())


def _listener_holders(port: int) -> list[int]:
    """The processes that hold the port's listening socket (those whose files can be read here)."""
    inodes = listening_inodes(port)
    if not inodes:
        return []
    wanted = {f"socket:[{inode}]" for inode in inodes}
    holders = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        if any(_link(fd) in wanted for fd in fds):
            holders.append(int(entry.name))
    return holders


def _link(fd: Path) -> str | None:
    try:
        return os.readlink(fd)
    except OSError:  # closed meanwhile
        return None


def listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on the port, from /proc/net; None where /proc/net is missing (not Linux)."""
    inodes: set[str] = set()
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found_table = True
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes if found_table else None


def owns_listener(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the listening socket of the port; None when it cannot be told."""
    inodes = listening_inodes(port)
    if inodes is None:
        return None
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any(link.startswith("socket:[") and link[8:-1] in inodes for link in links)


class EmbeddedBroker(BrokerLauncher):
    def __init__(
        self,
        data_dir: Path,
        port: int = 9092,
        host: str = "127.0.0.1",
        takeover_wait_s: float | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.port = port
        self.host = host
        self.bootstrap_servers = f"{host}:{port}"
        self.takeover_wait_s = TAKEOVER_WAIT_S if takeover_wait_s is None else takeover_wait_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def description(self) -> str:
        return f"noida-db {noida_version()} (embedded)"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> str:
        """Start noida-db and wait until it answers; its bootstrap servers.

        Call it from a thread that lives as long as the broker should (the main thread of `run`):
        the parent-death signal fires when the starting thread ends, not only the process.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._claim()
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
            # in order, instead of killing both at once. The parent-death signal covers the rest.
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGTERM),  # noqa: PLW1509 - see lifeline
            )
        logger.info(
            "broker starting pid=%d bootstrap=%s data_dir=%s", self._process.pid, self.bootstrap_servers, self.data_dir
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info("broker ready pid=%d bootstrap=%s", self._process.pid, self.bootstrap_servers)
        return self.bootstrap_servers

    def _claim(self) -> None:
        """Make sure our child will be the only broker on this port and this data dir.

        A broker from an earlier run whose parent was killed is still saving its data: wait for it.
        Anything else is an error the operator must resolve; running against it would look fine
        and write to someone else's broker.
        """
        deadline = time.monotonic() + self.takeover_wait_s
        waiting_logged = False
        while True:
            previous = previous_broker(self.data_dir)
            busy = port_in_use(self.host, self.port)
            if previous is None and not busy:
                return
            if previous is None and not (_exiting_broker(self.data_dir, self.port) and time.monotonic() < deadline):
                raise BrokerError(
                    f"port {self.port} on {self.host} is already in use by another process, so the embedded broker "
                    f"cannot listen there; stop that process, or pick another port (--broker-port for run, --port "
                    f"for broker), or give --bootstrap-servers to use a broker that is already running"
                )
            if previous is None:  # this data dir's broker, exiting: its port goes with it
                time.sleep(0.2)
                continue
            if time.monotonic() >= deadline:
                raise BrokerError(self._taken(previous))
            if not waiting_logged:
                logger.warning(
                    "waiting for the previous broker of this data dir to stop pid=%d data_dir=%s wait_s=%.0f",
                    previous,
                    self.data_dir,
                    self.takeover_wait_s,
                )
                waiting_logged = True
            time.sleep(0.2)

    def _taken(self, previous: int) -> str:
        return (
            f"another noida-db broker (pid {previous}) serves {self.data_dir}: another run or broker command "
            f"on the same directory, or one left from an earlier run. Stop it with: noida-db down --data-dir "
            f"{self.data_dir} (or kill {previous}), or use another --state-dir; then start again"
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        process = self._process
        assert process is not None
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = (self.data_dir / "broker.log").read_text(errors="replace")[-2000:]
                # One that started between `_claim`'s look and ours: noida-db names it as it refuses.
                running = _ALREADY_RUNNING.search(tail)
                if running is not None:
                    raise BrokerError(self._taken(int(running[1])))
                raise BrokerError(
                    f"the embedded broker exited with code {process.returncode} before it was ready; is port "
                    f"{self.port} already in use? Pick another port (--broker-port for run, --port for broker). "
                    f"Its log ends:\n{tail}"
                )
            try:
                wait_for_metadata(self.bootstrap_servers, timeout_s=1.0)
            except BrokerError:
                continue
            # Whoever answered must be our child: another process may have taken the port since _claim.
            if process.poll() is None and owns_listener(process.pid, self.port) is not False:
                return
            time.sleep(0.1)
        raise BrokerError(
            f"the embedded broker did not answer within {START_TIMEOUT_S:.0f}s; see {self.data_dir / 'broker.log'}"
        )

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        began = time.monotonic()
        saved = self._stop_kafka_service()
        process.send_signal(signal.SIGTERM)
        grace = EXIT_GRACE_S if saved else STOP_GRACE_S
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            logger.warning(
                "broker did not exit; killing it, writes since its last save may be lost pid=%d grace_s=%.0f",
                process.pid,
                grace,
            )
            process.kill()
            process.wait()
        logger.info(
            "broker stopped bootstrap=%s saved=%s stop_s=%.1f",
            self.bootstrap_servers,
            saved,
            time.monotonic() - began,
        )

    def _stop_kafka_service(self) -> bool:
        """`noida-db stop kafka`: stops serving, then saves. True once the data is saved."""
        command = [str(noida_binary()), "stop", "kafka", "--data-dir", str(self.data_dir)]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                timeout=STOP_GRACE_S,
                check=False,
                preexec_fn=die_with_parent(signal.SIGTERM),
            )
        except subprocess.TimeoutExpired:
            logger.warning("broker did not save its data in time; stopping it with SIGTERM grace_s=%.0f", STOP_GRACE_S)
            return False
        if done.returncode != 0:
            output = (done.stdout + done.stderr).decode(errors="replace").strip().splitlines()
            logger.warning(
                "broker stop command failed; stopping it with SIGTERM rc=%d output=%r",
                done.returncode,
                output[-1] if output else "",
            )
            return False
        return True
