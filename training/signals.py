"""Stopping a run cleanly on SIGTERM / SIGINT: finish the current step, checkpoint, exit with
the signal's conventional code (143 / 130)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

EXIT_SIGTERM, EXIT_SIGINT = 143, 130

# a stop asked from outside the main thread, where no signal arrives: a Ray Train worker runs
# the trainer in a thread of its own and learns of its job's cancel from its driver
# (training/ray_train.py); every StopFlag of this process reads it as that signal
_requested: int | None = None


def request_stop(signum: int = signal.SIGTERM) -> None:
    """Stop this process's run after the current step, as if ``signum`` had arrived."""
    global _requested
    _requested = signum


def clear_requested_stop() -> None:
    global _requested
    _requested = None


class StopFlag:
    """SIGTERM/SIGINT -> finish the current step, checkpoint, exit."""

    REPEAT_S = 1.0  # a second SIGINT sooner than this is the same Ctrl-C delivered twice
    # (the terminal's and the one ``processes: N``'s launcher forwards: training/launch.py)

    def __init__(self) -> None:
        self._signum: int | None = None
        self._at = 0.0
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals can only be handled in the main thread (e.g. the jobs API)
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)

    @property
    def signum(self) -> int | None:
        """The signal that asked this run to stop (or :func:`request_stop`'s), if any."""
        return self._signum if self._signum is not None else _requested

    def _handle(self, signum: int, frame: Any) -> None:
        if self._signum is not None:
            if (signum == signal.SIGINT
                    and time.monotonic() - self._at > self.REPEAT_S):
                raise KeyboardInterrupt  # second Ctrl-C: give up immediately
            return
        self._signum, self._at = signum, time.monotonic()
        log.warning("received %s: stopping after this step", signal.Signals(signum).name)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    @property
    def exit_code(self) -> int:
        """The process exit code for a run this flag stopped."""
        return EXIT_SIGINT if self.signum == signal.SIGINT else EXIT_SIGTERM
