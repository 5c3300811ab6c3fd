"""systemd notify: one datagram to $NOTIFY_SOCKET (abstract names start with '@'); no package."""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("understudy.sdnotify")


class Notifier:
    """Sends ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``STOPPING=1``; a no-op outside systemd."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = ("\0" + addr[1:]) if addr.startswith("@") else (addr or None)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ok_pid = not pid or pid == str(os.getpid())
        self.watchdog_interval_s: float | None = (int(usec) / 1e6 / 2) if usec.isdigit() and int(usec) > 0 and ok_pid else None
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Send the fields as one datagram; False (logged once per error) if it could not go."""
        if self.address is None:
            return False
        msg = "\n".join(fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # a reader that stopped reading must never stall the loop
            self._sock.sendto(msg, self.address)
            return True
        except BlockingIOError:
            log.debug("sd_notify queue full; dropped %r", msg[:40])
            return False
        except OSError as e:
            log.warning("sd_notify to %r failed: %s", self.address, e)
            return False

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
