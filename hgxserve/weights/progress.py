"""A progress line with throughput and ETA: redrawn on a TTY, plain periodic lines otherwise.

progress = Progress("sync", total_bytes=4 << 30, total_files=204)
progress.add(len(chunk)); progress.file_done(); progress.close()
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    """1.5 GiB style sizes.

    human_bytes(3 << 29)  # "1.50 GiB"
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class Progress:
    """Thread-safe byte/file counters and a reporter thread."""

    def __init__(
        self,
        label: str,
        total_bytes: int,
        total_files: int,
        stream: TextIO | None = None,
        quiet: bool = False,
    ) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = 0.5 if self.tty else 10.0
        self.quiet = quiet
        self.done_bytes = 0
        self.done_files = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not quiet and total_bytes > 0:
            self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
            self._thread.start()

    def add(self, n: int) -> None:
        with self._lock:
            self.done_bytes += n

    def file_done(self) -> None:
        with self._lock:
            self.done_files += 1

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.done_bytes / elapsed
        left = self.total_bytes - self.done_bytes
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        return (
            f"{self.label}: {human_bytes(self.done_bytes)}/{human_bytes(self.total_bytes)} "
            f"{pct:3.0f}%  {human_bytes(rate)}/s  ETA {eta}  "
            f"files {self.done_files}/{self.total_files}"
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._emit()

    def _emit(self, final: bool = False) -> None:
        text = self.line()
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._emit(final=True)
            self._thread = None

    def rate(self) -> float:
        return self.done_bytes / max(time.monotonic() - self.started, 1e-6)
