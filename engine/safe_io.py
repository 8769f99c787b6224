"""Reading files a user named, without hanging or exhausting memory.

A path typed into the CLI or the app, or stored in a shared session, can name a FIFO (an open for
reading blocks until a writer comes), a device (`/dev/zero` never ends) or a file far larger than its
kind ever is. Every read here accepts regular files only, opens without blocking, and is bounded.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

KIB, MIB = 1 << 10, 1 << 20


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def not_regular(path: str | Path) -> str | None:
    """What `path` is when it exists but is not a regular file ("a FIFO (named pipe)", "a device", ...),
    from a stat that follows symlinks and never opens it; None for a regular or a missing file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"not readable ({err.strerror or err})"
    return None if stat.S_ISREG(mode) else _kind(mode)


def open_regular(path: str | Path, what: str, error: type[Exception],
                 missing: str | None = None) -> tuple[BinaryIO, int]:
    """(binary file opened for reading, its size) when `path` is a regular file (symlinks followed);
    otherwise `error` with a message naming the path and what it is (`missing`: the message for a
    path that does not exist). Opening never blocks."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path}: {missing or f'no such {what}'}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a {what}") from None
    except PermissionError:
        raise error(f"{path}: cannot read the {what} (permission denied)") from None
    except OSError as err:
        raise error(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: is {_kind(st.st_mode)}, not a {what}; give a plain file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | Path, what: str, limit: int, error: type[Exception],
               missing: str | None = None) -> bytes:
    """The whole of a regular file of at most `limit` bytes (`error` otherwise)."""
    f, size = open_regular(path, what, error, missing)
    with f:
        if size > limit:
            raise error(f"{path}: the {what} is {size:,} bytes, more than a {what} can be ({limit:,}); "
                        "is this the right file?")
        try:
            data = f.read(limit + 1)
        except OSError as err:
            raise error(f"{path}: cannot read the {what} ({err.strerror or err})") from None
    if len(data) > limit:  # the file grew while we read it
        raise error(f"{path}: the {what} is more than {limit:,} bytes")
    return data


def read_text(path: str | Path, what: str, limit: int, error: type[Exception],
              missing: str | None = None) -> str:
    """A regular file's text, which must be UTF-8 (`error` naming the first bad byte otherwise)."""
    data = read_bytes(path, what, limit, error, missing)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{path}: the {what} is not UTF-8 text (byte {err.start:,} is invalid)") from None
