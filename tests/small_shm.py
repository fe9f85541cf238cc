"""Running a test's body where /dev/shm is small, as in a container (Docker's default: 64 MiB).

    small_shm(body)                                   a pytest fixture (tests/conftest.py): Python source
      └─ unshare -m sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec python script.py'
           └─ script.py: the body (it makes and closes its own pools), then the check that nothing
              is left: /dev/shm empty (a fresh tmpfs: anything there is soma's), no spill directory

The body runs in a private mount namespace of its own (`unshare -m`: the mount is
seen by that process and its children only, soma's workers included), so the rest
of the machine keeps its /dev/shm. It needs root (or CAP_SYS_ADMIN), as CI and
this machine have; elsewhere the test is skipped, saying why. Ray is not involved.
The body's stdout is returned; a body that fails (or leaves anything) fails the
test with its output.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import os, sys, tempfile, time
st = os.statvfs("/dev/shm")
assert st.f_blocks * st.f_frsize == {mib} << 20, "not in the small /dev/shm"
assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")
"""

_POSTLUDE = """
def _left():
    spills = [n for n in os.listdir(tempfile.gettempdir()) if n.endswith("-spill")]
    return os.listdir("/dev/shm") + spills
_deadline = time.monotonic() + 10  # (a closed pool's workers may still be exiting: they unlink their own)
while _left() and time.monotonic() < _deadline:
    time.sleep(0.05)
assert not _left(), f"left after close(): {_left()}"
print("NOTHING LEFT")
"""


@functools.lru_cache(maxsize=None)
def why_no_small_shm() -> str | None:
    """None when a private mount namespace with its own /dev/shm can be made here; otherwise why not."""
    if shutil.which("unshare") is None:
        return "unshare is missing: no private mount namespace for a small /dev/shm"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return (f"this machine does not let a test mount a small /dev/shm in a private mount namespace "
                f"(unshare -m + mount: {probe.stderr.strip() or probe.returncode}); it needs root or CAP_SYS_ADMIN")
    return None


def run_in_small_shm(body: str, tmp_path, mib: int = 64, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `body` (Python source) in a fresh process whose /dev/shm is a `mib` MiB tmpfs of its own; the
    completed process (its stdout and stderr as text). Fails the test when the body fails or leaves anything."""
    script = tmp_path / "body.py"
    script.write_text(_PRELUDE.format(mib=mib) + textwrap.dedent(body) + _POSTLUDE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    command = f"mount -t tmpfs -o size={mib}m tmpfs /dev/shm && exec {sys.executable} {script}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)
    assert done.returncode == 0 and "NOTHING LEFT" in done.stdout, (
        f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    return done
