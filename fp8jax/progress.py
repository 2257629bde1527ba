"""A plain-text progress bar for long commands (converter, data preparation).

On a terminal it redraws one line at most five times a second; in a log
(not a terminal) it writes one line per tenth of the work.  Units are bytes,
shown in MB with the rate, or whole items of a named unit.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Plain-text progress bar on a stream (stderr by default)."""

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        width: int = 30,
        quiet: bool = False,
        unit: str = "bytes",
    ):
        self.quiet = quiet
        # "bytes" shows MB and MB/s; any other unit counts whole items ("windows").
        self.unit = unit
        self.total = max(int(total), 1)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.done = 0
        self.t0 = time.monotonic()
        self._last = -1.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def update(self, n: int, what: str = "") -> None:
        self.done += int(n)
        if self.quiet:
            return
        now = time.monotonic()
        frac = min(self.done / self.total, 1.0)
        decile = int(frac * 10)
        # On a terminal redraw at most 5x a second; in a log, one line per 10%.
        if self._tty:
            if now - self._last < 0.2 and frac < 1.0:
                return
        elif decile == self._last_decile and frac < 1.0:
            return
        self._last, self._last_decile = now, decile
        fill = int(frac * self.width)
        rate = self.done / max(now - self.t0, 1e-9)
        if self.unit == "bytes":
            count = f"{self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB {rate / 1e6:,.1f} MB/s"
        else:
            count = f"{self.done:,}/{self.total:,} {self.unit} {rate:,.2f}/s"
        line = f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {frac:6.1%} {count} {what}"
        if self._tty:
            self.stream.write("\r" + line[:160].ljust(160))
            if frac >= 1.0:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
