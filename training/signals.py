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


class StopFlag:
    """SIGTERM/SIGINT -> finish the current step, checkpoint, exit."""

    REPEAT_S = 1.0  # a second SIGINT sooner than this is the same Ctrl-C delivered twice
    # (the terminal's and the one ``processes: N``'s launcher forwards: training/launch.py)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._at = 0.0
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals can only be handled in the main thread (e.g. the jobs API)
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            if (signum == signal.SIGINT
                    and time.monotonic() - self._at > self.REPEAT_S):
                raise KeyboardInterrupt  # second Ctrl-C: give up immediately
            return
        self.signum, self._at = signum, time.monotonic()
        log.warning("received %s: stopping after this step", signal.Signals(signum).name)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    @property
    def exit_code(self) -> int:
        """The process exit code for a run this flag stopped."""
        return EXIT_SIGINT if self.signum == signal.SIGINT else EXIT_SIGTERM
