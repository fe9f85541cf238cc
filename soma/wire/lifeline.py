"""A pool's lifeline: how a pool started later knows that another pool's files were left by processes that are all
dead, and removes them.

A pool's workers clean up after a host that died (they watch it). When the host and its workers die together
(SIGKILL or SIGTERM to every process: a container's out-of-memory kill of the whole group, `systemctl stop`,
`pkill python`, a notebook kernel's restart), nobody is left to, and its segments hold /dev/shm, which is memory
(a container has 64 MiB of it by default), until a reboot: measured, two such kills left 24 MiB and 8 MiB.

A pid cannot say that a pool is dead: a pid not alive here may be a live host's in another pid namespace sharing
/dev/shm (two containers of a pod). A lock can. The host holds a shared `flock` on `/dev/shm/<prefix>.alive` for
the pool's life; the kernel lets go of it when the last descriptor of that file closes, however the process
ended, and every namespace that sees the file sees the lock. A pool starting (`sweep`) tries each other pool's
lifeline with an exclusive lock that does not wait: it gets it only when no live process holds the file, and
then removes that pool's files (`remove_pool`: its segments, its spill directory and its socket directory, whose
paths the lifeline holds), the lifeline last. Only this user's lifelines are tried (another user's pools are
theirs to sweep), only plain files, without waiting to open them. A pool without a lifeline (a soma from before
Dec 7) is left alone. What stays: a host killed after its pool started with /dev/shm full to the last page (no
room to write the paths) leaves its socket directory, and a spill directory `$SOMA_SPILL_DIR` put elsewhere than
the sweeping pool's; a pool some process forked from its host still lives in is kept until that process ends
(it holds the lifeline too).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import time

from .._log import warn
from ..errors import size_text
from .room import SHM_DIR, spill_dir, unlink_all

SUFFIX = ".alive"
STARTING = ".starting"  # a lifeline's name while its host makes it
STALE_START_S = 60.0  # a lifeline still being made after this long was being made by a host that died
_LIFELINE = re.compile(rf"^(soma-\d+-[0-9a-f]+)({re.escape(SUFFIX)}|{re.escape(STARTING)})$")
_RUN_DIR = re.compile(r"^soma-[A-Za-z0-9_]+$")  # (tempfile.mkdtemp(prefix="soma-"): the pool's socket directory)


def path_of(prefix: str) -> str:
    return os.path.join(SHM_DIR, prefix + SUFFIX)


class Lifeline:
    """This pool's lifeline, held from before its first segment until `end` (or until the process dies)."""

    def __init__(self, prefix: str, run_dir: str):
        self.prefix = prefix
        self.run_dir = run_dir
        self.fd = None
        # Made under another name, locked, then renamed: under its own name a lifeline is held from its first
        # moment, so a sweep never takes a pool that is starting (made under its name, then locked, a sweep
        # between the two took it and said it removed a dead pool, naming a live one: a tester's).
        starting = os.path.join(SHM_DIR, prefix + STARTING)
        try:
            fd = os.open(starting, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as err:
            _no_lifeline(starting, err)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.write(fd, json.dumps({"run_dir": run_dir, "spill_dir": spill_dir(prefix)}).encode())
            except OSError:
                pass  # (/dev/shm full to the last page: a sweep still finds the segments by name, not the directories)
            os.rename(starting, path_of(prefix))
        except OSError as err:
            os.close(fd)
            _unlink_quietly(starting)
            _no_lifeline(starting, err)
            return
        self.fd = fd

    def end(self) -> None:
        """The pool closed: remove its files, the lifeline last, and let go of it."""
        remove_pool(self.prefix, self.run_dir, None)  # (None: this process's spill directory, the pool's)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _no_lifeline(path: str, err: OSError) -> None:
    # No lifeline (no /dev/shm, or no room in it for a file): the pool works, but its files cannot be told apart
    # from a live pool's if all its processes are killed at once.
    warn("soma.shm", "soma: could not make %s (%s: %s); if this pool's processes are all killed at once, its files "
         "in /dev/shm stay until removed by hand", path, type(err).__name__, err)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_pool(prefix: str, run_dir: str | None, spill: str | None) -> int:
    """Remove pool `prefix`'s files: its segments (in /dev/shm and in `spill`), its socket directory `run_dir`,
    its lifeline last. Idempotent: the host's close, a worker whose host died, and a later pool's sweep may all
    do it. The number of segments removed."""
    removed = unlink_all(prefix, spill=spill)
    if run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    _unlink_quietly(path_of(prefix))
    return removed


def sweep(own_prefix: str) -> None:
    """Remove the files of every pool of this user whose processes are all dead (see the module's docstring);
    say once what was removed. Never raises: it is housekeeping, and a pool must start without it."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    swept = []  # (host pid, segments removed, their bytes)
    for name in names:
        found = _LIFELINE.match(name)
        if found is None or found.group(1) == own_prefix:
            continue
        if found.group(2) == STARTING:
            _remove_if_stale_start(os.path.join(SHM_DIR, name))
            continue
        removed = _remove_if_dead(found.group(1), names)
        if removed is not None:
            swept.append((found.group(1).split("-")[1], *removed))
    swept = [one for one in swept if one[1]]  # (a host killed alone: its workers removed their segments themselves)
    if swept:
        warn("soma.shm", "soma: removed what %d earlier pool(s) left when they were killed (host pid %s): "
             "%d segment(s), %s of /dev/shm", len(swept), ", ".join(pid for pid, _, _ in swept),
             sum(n for _, n, _ in swept), size_text(sum(b for _, _, b in swept)))


def _bytes_of(prefix: str, names: list) -> int:
    total = 0
    for name in names:
        if name.startswith(prefix + "-"):
            try:
                total += os.stat(os.path.join(SHM_DIR, name)).st_size
            except OSError:
                pass
    return total


def _remove_if_dead(prefix: str, names: list) -> tuple[int, int] | None:
    """Remove pool `prefix`'s files when nobody holds its lifeline: `(segments removed, their bytes in /dev/shm)`;
    None when it lives (or another sweep, or its own close, got there first)."""
    fd = _unheld(path_of(prefix))
    if fd is None:
        return None
    try:
        paths = _paths_in(fd)
        size = _bytes_of(prefix, names)
        return remove_pool(prefix, _checked_run_dir(paths.get("run_dir")),
                           _checked_spill(prefix, paths.get("spill_dir"))), size
    except OSError:
        return None
    finally:
        os.close(fd)


def _remove_if_stale_start(path: str) -> None:
    """A lifeline a host was making (`Lifeline`) when it died, STALE_START_S old and held by nobody: removed
    silently (no segment was made before it had its name)."""
    fd = _unheld(path)
    if fd is not None:
        try:
            if time.time() - os.fstat(fd).st_mtime > STALE_START_S:
                _unlink_quietly(path)
        finally:
            os.close(fd)


def _unheld(path: str) -> int | None:
    """A descriptor of the lifeline at `path`, locked exclusively: nobody else holds it. None when a process
    holds it, or it is gone, or it is not a plain file of this user's (a FIFO of that name blocked every pool's
    start in `open`, a tester's; another user's pools are theirs to sweep: their socket directory is not ours
    to remove)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink:  # (still the file of that name: not removed by another sweep meanwhile)
                fd, held = None, fd
                return held
    except OSError:
        pass  # (held by a live process of that pool: EWOULDBLOCK; anything else: not ours to judge, left alone)
    finally:
        if fd is not None:
            os.close(fd)
    return None


def _paths_in(fd: int) -> dict:
    try:
        paths = json.loads(os.read(fd, 1 << 16) or b"{}")
    except (OSError, ValueError):
        return {}  # (killed before it was written: its segments are still found by name)
    return paths if isinstance(paths, dict) else {}


def _checked_run_dir(path) -> str | None:
    """`path` when it is a socket directory of this user's pools (a soma-* directory, not a link), else None:
    a lifeline is a file anyone of this user could write, and rmtree must not be pointed elsewhere by it."""
    if not isinstance(path, str) or not os.path.isabs(path) or not _RUN_DIR.match(os.path.basename(path)):
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return path if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() else None


def _checked_spill(prefix: str, path) -> str | None:
    """`path` when it is pool `prefix`'s spill directory (its name says so), else None."""
    if isinstance(path, str) and os.path.isabs(path) and os.path.basename(path) == f"{prefix}-spill":
        return path
    return None
