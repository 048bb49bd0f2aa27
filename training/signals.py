"""Graceful stop on SIGINT / SIGTERM: finish the step, save, exit."""
from __future__ import annotations

import signal


class StopFlag:
    """SIGINT/SIGTERM ask the loop to finish the current step, save, and exit; a second SIGINT
    interrupts at once."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
