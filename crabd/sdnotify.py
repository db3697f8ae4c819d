"""systemd's notify protocol (sd_notify(3)) without libsystemd.

`systemd/crabd.service` is `Type=notify`: systemd considers crabd started only
when crabd sends READY=1, which `crabd serve` does once its API socket
accepts connections (so `systemctl start crabd && crabd sandbox ls` never
races the daemon). STATUS= lines show in `systemctl status`; WATCHDOG=1 keeps
a unit with WatchdogSec= alive; STOPPING=1 marks a clean shutdown.

The protocol is one datagram per message to the AF_UNIX socket named by
$NOTIFY_SOCKET; a leading '@' names an abstract socket. Outside systemd
(NOTIFY_SOCKET unset: tests, a shell, docker) every call is a no-op, so the
daemon calls these unconditionally. A failed send is logged, not raised:
losing a status line must never take the daemon down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Mapping

__all__ = ["Notifier", "notify", "ready", "status", "watchdog", "stopping", "watchdog_interval"]

log = logging.getLogger(__name__)


class Notifier:
    """Sends notify messages to one socket address (None = no-op)."""

    def __init__(self, address: str | None) -> None:
        self.address = address or None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Notifier":
        return cls((env if env is not None else os.environ).get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def _sockaddr(self) -> str | bytes:
        assert self.address is not None
        if self.address.startswith("@"):
            # Abstract namespace: a leading NUL byte instead of '@', no file.
            return b"\0" + self.address[1:].encode()
        return self.address

    def notify(self, *fields: str) -> bool:
        """Send "KEY=value" fields in one datagram; True if sent, False if no-op or failed."""
        if self.address is None:
            return False
        if not fields or any("\n" in f for f in fields):
            raise ValueError("notify fields are non-empty KEY=value strings without newlines")
        msg = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(msg, self._sockaddr())
        except OSError as e:
            log.warning("sd_notify to %s failed: %s", self.address, e)
            return False
        return True

    def ready(self, status_text: str | None = None) -> bool:
        """READY=1: startup finished, the API accepts connections."""
        return self.notify("READY=1", *([f"STATUS={_one_line(status_text)}"] if status_text else []))

    def status(self, text: str) -> bool:
        """STATUS=: one free-form line shown by `systemctl status`."""
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """WATCHDOG=1: the keep-alive ping for units with WatchdogSec=."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status_text: str | None = None) -> bool:
        """STOPPING=1: a clean shutdown began."""
        return self.notify("STOPPING=1", *([f"STATUS={_one_line(status_text)}"] if status_text else []))

    async def keep_alive(self, interval: float, *, ping_fraction: float = 0.5) -> None:
        """Ping the watchdog every `interval * ping_fraction` s until cancelled.

        Half the interval, as sd_watchdog_enabled(3) recommends, so one late
        wakeup of a busy event loop does not get the daemon killed. Run it as
        a task on the daemon's own loop: a blocked loop then stops the pings,
        which is exactly what the watchdog exists to catch.
        """
        period = interval * ping_fraction
        while True:
            self.watchdog()
            await asyncio.sleep(period)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds within which systemd expects WATCHDOG=1, or None if no watchdog.

    From $WATCHDOG_USEC; None if it is unset, unparsable or 0, or if
    $WATCHDOG_PID names another process (the variables were inherited by a
    child of the watched process, which must not ping on its behalf).
    """
    env = env if env is not None else os.environ
    raw = env.get("WATCHDOG_USEC")
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 1_000_000


# Module-level helpers read $NOTIFY_SOCKET at each call, so a daemon started
# by systemd and a test that sets the variable both just work.
def notify(*fields: str) -> bool:
    return Notifier.from_env().notify(*fields)


def ready(status_text: str | None = None) -> bool:
    return Notifier.from_env().ready(status_text)


def status(text: str) -> bool:
    return Notifier.from_env().status(text)


def watchdog() -> bool:
    return Notifier.from_env().watchdog()


def stopping(status_text: str | None = None) -> bool:
    return Notifier.from_env().stopping(status_text)
