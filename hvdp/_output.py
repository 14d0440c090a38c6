"""Whole lines on a launched rank's stdout and stderr (issue 46).

A launcher tags each rank's output as it reads it: mpirun's --tag-output puts its tag before every fragment it
reads, so a rank that writes part of a line (`print(..., end="", flush=True)`, pytest's progress dots, Python's
own `print`, which writes the text and its newline in two calls under `python -u`) has another rank's tagged
fragment, or Horovod's C++ log line on the same pipe, glued into the middle of its line. From hvdp's init()
under a launcher, sys.stdout and sys.stderr pass on whole lines only: each write that completes lines is one
write of those lines; the rest of a line waits for its end ("\\n", or "\\r": a progress bar's redraw), or for
the process's exit (which ends it with a newline). HVDP_WHOLE_LINES=0 keeps Python's own streams.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

_ENDS = ("\n", "\r")


def split_whole(pending: str, text: str) -> tuple[str, str]:
    """(the whole lines to write now, what stays pending) after `text` is appended to `pending`."""
    joined = pending + text
    cut = max(joined.rfind(end) for end in _ENDS) + 1
    return joined[:cut], joined[cut:]


class WholeLines:
    """A text stream over `stream` that writes whole lines only (see the module's docstring). Everything but
    write() and flush() is the wrapped stream's (fileno, encoding, isatty, buffer...)."""

    def __init__(self, stream):
        self._stream = stream
        self._pending = ""
        self._lock = threading.RLock()  # re-entrant: a signal handler that prints runs on the writing thread

    def write(self, text: str) -> int:
        with self._lock:
            whole, self._pending = split_whole(self._pending, text)
            if whole:
                self._stream.write(whole)
                self._stream.flush()
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """The whole lines are written already; a partial line waits for its end (a flush mid-line is what
        glues another rank's output into it)."""
        self._stream.flush()

    def close_line(self) -> None:
        """Write what is pending, ended by a newline (at exit, or before the process ends itself: the
        launcher would put the next tag after it)."""
        with self._lock:
            pending, self._pending = self._pending, ""
        if pending:
            self._stream.write(pending + "\n")
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def whole_lines(environ=None) -> bool:
    """Put WholeLines over sys.stdout and sys.stderr unless HVDP_WHOLE_LINES is 0/false/off or a stream is
    wrapped already. Returns whether both streams are wrapped now. Called by init() under a launcher only."""
    env = os.environ if environ is None else environ
    if env.get("HVDP_WHOLE_LINES", "1").lower() in ("0", "false", "off"):
        return False
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, WholeLines):
            continue  # a terminal too: mpirun gives its ranks a pty for stdout, and tags what it reads from it
        wrapped = WholeLines(stream)
        setattr(sys, name, wrapped)
        atexit.register(wrapped.close_line)
    return isinstance(sys.stdout, WholeLines) and isinstance(sys.stderr, WholeLines)


def close_lines() -> None:
    """Write any partial line of both streams (before os._exit, which skips atexit)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, WholeLines):
            stream.close_line()
