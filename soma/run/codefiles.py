"""The files of a node's code a worker imports: whether they changed on disk since the node was sent.

A node of an importable module travels by reference: each worker imports the
module once, when it first runs one of its nodes. A module edited on disk since
the node was sent (or reloaded: `importlib.reload`, `%autoreload` in a notebook)
runs as it was in the workers that have it, and as it is now in one that imports
it from then on (one that had not run the node yet, or a replacement): one pool,
one node, two answers ('v1' and 'v2' in one map, found by a tester). `CodeFiles`
notes, when the node is sent, each such file's content (a digest); `changed`
looks again. A file is read again only when its modification time or size moved
(`_digest`), so `touch`, a save without an edit or a checkout there and back is
no change. The registry looks at most every LOOK_EVERY_S on a run's way and at
each map's start, each file once a look (`Look`), whatever number of nodes share it.
The files: those of the node's functions and of the modules of its classes (the
registry finds them: its bases, the torch modules it holds); not libraries'.
`__main__`'s code travels by value, with the node: not watched. Where nodes share
the workers (Local), a pool also keeps every version it sent of each (`SentFiles`),
and the folders its workers import them from (`roots`: a module found through a
relative sys.path entry, '' in a notebook, is not found there after an os.chdir).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys

_DIGESTS: dict = {}  # path → (mtime_ns, size, digest) when last read: read again only when either moved


@functools.cache
def _libraries() -> tuple:
    """Where libraries live (torch's modules, numpy's): not looked at (nobody edits them under a running pool,
    and a large model's submodules come from dozens of their files)."""
    import sysconfig

    return tuple({os.path.join(p, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")
                  if (p := sysconfig.get_paths().get(key))})


class CodeFiles:
    """The files of a node's own code that workers import, and their digests when it was sent."""

    __slots__ = ("paths", "then", "roots")

    def __init__(self, paths: list, roots: list = ()):
        self.paths = paths
        self.roots = roots  # the folders their modules are imported from (`_import_root`)
        self.noted()

    @classmethod
    def of(cls, functions: list, classes: list = ()) -> "CodeFiles | None":
        """The files of the node's own functions (its forward, forward_batch, setup; a soma.fn's function) and
        of the modules of `classes` (registry._classes_of), but `__main__`'s and libraries' (the standard
        library's, site-packages'), that are there to look at; None when none is. With the folders the modules of
        both are imported from (`roots`)."""
        main = sys.modules.get("__main__")
        files = {f.__code__.co_filename for f in functions if sys.modules.get(f.__module__) is not main}
        of_classes = [m for c in classes if (m := sys.modules.get(c.__module__)) is not None and m is not main]
        files.update(getattr(module, "__file__", None) for module in of_classes)
        modules = [m for f in functions if (m := sys.modules.get(f.__module__)) is not None and m is not main]
        modules = dict.fromkeys(modules + of_classes)
        libraries = _libraries()
        paths = sorted(p for p in files if isinstance(p, str) and not p.startswith(libraries) and os.path.isfile(p))
        if not paths:
            return None
        roots = [root for module in modules
                 if (root := _import_root(module)) and not os.path.join(root, "").startswith(libraries)]
        return cls(paths, list(dict.fromkeys(roots)))

    def noted(self) -> None:
        """The node is sent (again: another pool): its copies run these files as they are now."""
        self.then = tuple(_digest(path) for path in self.paths)

    def changed(self, look: "Look", sent: "SentFiles | None" = None) -> list[str]:
        """The files whose content is not what it was when noted (a file gone is not: nothing to compare); with
        the `sent` of the pool asking, not what every version its workers may have imported was (none: that pool
        never sent a node of it, and the one it sends is looked at then)."""
        return [path for path, then in zip(self.paths, self.then)
                if (now := look(path)) is not None and (sent.seen.get(path, {now}) if sent else {then}) != {now}]


class SentFiles:
    """The code files a pool's workers may have imported: each one's digests when the pool sent a node of it.

    Where every node shares the worker processes (Local), a module is imported once per worker, for the first
    node of it that worker runs: a new node of a module edited, or reloaded in this process (`importlib.reload`,
    `%autoreload`), since then runs the module as the workers imported it, not as this process has it now (a
    tester's notebook: the new node answered with the old code, silently). Every version sent is kept: a file
    edited and edited back may still run as the edit in a worker that imported it meanwhile. Ray gives each node
    actors of its own: they import the module afresh."""

    __slots__ = ("seen", "roots")

    def __init__(self):
        self.seen: dict = {}  # path → the digests it had when this pool sent nodes of it
        self.roots: dict = {}  # the folders the modules of the nodes sent are imported from (as keys, in order)

    def sent(self, files: CodeFiles) -> list[str]:
        """`files` are a node's, being sent to this pool: those whose workers may run another version of them."""
        self.roots.update(dict.fromkeys(files.roots))
        stale = []
        for path, now in zip(files.paths, files.then):
            if now is not None:
                versions = self.seen.setdefault(path, set())
                versions.add(now)
                if len(versions) > 1:
                    stale.append(path)
        return stale


def _import_root(module) -> str | None:
    """The folder `module` is imported from: its file's folder less one more per package it is in (`a.b` in
    /r/a/b.py: /r); None when the file's place does not match the module's name (one loaded from a path under
    another name: not importable by its name anywhere)."""
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not os.path.isabs(file):
        return None
    folder, base = os.path.split(file)
    names = module.__name__.split(".")
    if base.split(".")[0] != "__init__":
        if base.split(".")[0] != names.pop():
            return None
    for name in reversed(names):
        folder, last = os.path.split(folder)
        if last != name:
            return None
    return folder


class Look:
    """One look at the files: each read (`_digest`) once however many nodes ask."""

    __slots__ = ("seen",)

    def __init__(self):
        self.seen: dict = {}

    def __call__(self, path: str):
        seen = self.seen
        if path not in seen:
            seen[path] = _digest(path)
        return seen[path]


def _digest(path: str) -> bytes | None:
    try:
        st = os.stat(path)
    except OSError:
        return None  # (gone: a worker that needs it says so as it fails to load)
    known = _DIGESTS.get(path)
    if known is not None and known[0] == st.st_mtime_ns and known[1] == st.st_size:
        return known[2]
    try:
        with open(path, "rb") as f:
            digest = hashlib.blake2b(f.read(), digest_size=16).digest()
    except OSError:
        return None
    _DIGESTS[path] = (st.st_mtime_ns, st.st_size, digest)
    return digest
