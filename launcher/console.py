"""The launcher's output outlives its terminal.

`tandem run` prints for hours. Its stdout may be a pipe whose reader exits (`| head`, a `tee`
killed, a log shipper restarted) or a terminal that goes away (an ssh session dropped): a write
then raises BrokenPipeError (Python ignores SIGPIPE) or EIO. Unhandled, the first such print
ended a healthy run, and the next one, in the teardown, cut the teardown short. So `tandem run`
writes through `Console`: to the terminal until a write fails, then to
`<exp>/logs/launcher.out`, which says when and why; nothing it prints is lost, and the run goes
on.
"""
from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import TextIO


class Fallback:
    """`<exp>/logs/launcher.out`, opened when a stream first fails (shared by stdout and stderr)."""

    def __init__(self, path: Path):
        self.path = path
        self._file: TextIO | None = None

    def write(self, text: str) -> None:
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", buffering=1)   # noqa: SIM115 (kept open for the run)
            self._file.write(text)
            self._file.flush()
        except OSError:   # a full or vanished disk: the output is lost, not the run
            pass


class Console(io.TextIOBase):
    """A text stream that writes through to `stream` until a write fails, then to `fallback`."""

    def __init__(self, stream: TextIO, fallback: Fallback, name: str):
        self._stream: TextIO | None = stream
        self._fallback = fallback
        self.name = name

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def fileno(self) -> int:
        if self._stream is None:
            raise io.UnsupportedOperation(f"the launcher's {self.name} is gone")
        return self._stream.fileno()

    def write(self, text: str) -> int:
        if self._stream is not None:
            try:
                self._stream.write(text)
                self._stream.flush()   # a failure shows now, with the text it failed on
                return len(text)
            except OSError as e:       # BrokenPipeError; EIO from a terminal that is gone
                self._lost(e)
        self._fallback.write(text)
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except OSError as e:
                self._lost(e)

    def _lost(self, error: OSError) -> None:
        stream, self._stream = self._stream, None
        try:   # what the old stream still buffers would fail again at exit: it now goes nowhere
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass
        self._fallback.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} the launcher's {self.name} is gone "
                             f"({error}); its output goes on here ---\n")


def keep_output_going(logs: Path) -> None:
    """Make this process's stdout and stderr `Console`s falling back to `<logs>/launcher.out`.
    Call it before logging is configured, so its handler writes through the new stderr."""
    import sys
    fallback = Fallback(logs / "launcher.out")
    sys.stdout = Console(sys.stdout, fallback, "stdout")
    sys.stderr = Console(sys.stderr, fallback, "stderr")
