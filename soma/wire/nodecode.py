"""A node's code on its way to a worker, with its file name, line numbers and source lines kept.

    blob = nodecode.dumps(node)     # host: what `Local` sends once per node and worker
    node = nodecode.loads(blob)     # worker; why_not_loaded(err) says what to do when it raises

Why not plain `cloudpickle.dumps`: a class or function defined in `__main__` (a
script, a notebook) travels by value, code object and all, and cloudpickle >=
3.1 writes every such code object's `co_filename` as `"<dynamic-code>"` (it
wants byte-identical payloads wherever the code was defined). The line numbers
survive, the file name does not, so a node that raises in a worker shows
`File "<dynamic-code>", line 8, in forward` and the user cannot find the line.

`dumps` uses a cloudpickle pickler that rebuilds each by-value code object with
its real `co_filename`, and ships the source lines the code spans, taken from
the host's `linecache` (which also knows notebook cells that are no file). The
worker, rebuilding the code, hands those lines to its own `linecache` when the
file cannot be read there, so a traceback shows the source line too. The blob
is an ordinary pickle: `loads` is `pickle.loads`, and a worker that calls
`pickle.loads` itself gets the same node; unpickling imports only this module.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import threading
import types

_DYNAMIC = "<dynamic-code>"


def dumps(node) -> bytes:
    """The node's code and state, pickled by cloudpickle with file names and source lines kept (host side)."""
    with io.BytesIO() as file:
        _pickler_class()(file).dump(node)
        return file.getvalue()


def loads(blob: bytes):
    """The node back from `dumps` (worker side); it imports cloudpickle itself if the blob needs it."""
    _loading.depth = getattr(_loading, "depth", 0) + 1
    try:
        return pickle.loads(blob)
    finally:
        _loading.depth -= 1


# How many node loads this thread is in. A pool started by a thread while it loads one was started by the
# top-level code of a module the node's code imported: a script without `if __name__ == "__main__":`, whose
# pool's workers import it again and start pools of their own, process after process (soma.local.host.procs
# refuses). Per thread: a node that starts a pool of its own in its forward, on one thread of a worker, is not
# refused because another node's code loads on another (a count for the whole process refused it).
_loading = threading.local()


def loading() -> bool:
    """Whether this thread is loading a node's code now (importing its modules' top-level code)."""
    return getattr(_loading, "depth", 0) > 0


# Where a node's code was not found, and what to do: said for the process that loads it.
_NOT_FOUND = {
    "worker": ("a worker searches the host's sys.path as it was when the node was sent to it (its relative "
               "entries from the host's working directory then); define the node in a module they can import"),
    "Ray actor": ("a Ray actor imports the module of each node it runs on whichever machine of the cluster it is "
                  "on, so that module must be importable there, the same code on every machine: on the actor's "
                  "sys.path (it searches the driver's sys.path, where those folders exist on its machine), or "
                  "shipped to every machine with Ray's runtime_env (`soma.Ray(runtime_env={\"working_dir\": "
                  "...})` or `{\"py_modules\": [...]}`, or a node's `options=`); or define the node in a module "
                  "every machine can import"),
}


def why_not_loaded(err: BaseException, where: str = "worker") -> str:
    """What to do about `loads` raising `err` in a `where` ("worker": Local's; "Ray actor"), said from where
    it failed.

    A node of an importable module travels by reference: the worker imports that module, and the module's
    top-level code runs there, with the worker's sys.argv (its own program's arguments). A module that reads
    the command line as it is imported (`int(sys.argv[1])`, `parser.parse_args()`) fails there, and the
    worker's sys.path, the usual suspect, is not the cause. An ImportError, or pickle's "Can't get attribute":
    the module, or the class in it, could not be found (on a Ray cluster, on the machine the actor is on).
    Anything else came from code that runs as the node is unpickled (a `__setstate__` that opens a file the
    worker cannot, say): where to look is that code, not the sys.path.
    """
    frame, line = _importing(err)
    if frame is None:
        if isinstance(err, ImportError) or (isinstance(err, AttributeError) and
                                            str(err).startswith("Can't get attribute")):
            return _NOT_FOUND[where]
        return _unpickling_failed(err, where)
    module = frame.f_globals.get("__name__", "?")
    said = (f"importing module `{module}` here ran its top-level code, which raised at {frame.f_code.co_filename}, "
            f"line {line}")
    if {"argv", "parse_args", "parse_known_args"} & set(frame.f_code.co_names):
        given = f" (`{' '.join(sys.argv[1:3])} ...`)" if len(sys.argv) > 1 else ""
        return (f"{said}: it reads the command line as it is imported, and a {where}'s sys.argv holds its own "
                f"program's arguments{given}, not your script's; read arguments under "
                f"`if __name__ == \"__main__\":` and give nodes what they need as their attributes")
    return (f"{said}: a {where} imports the module of each node it runs, so that code runs again there; keep "
            f"what must run once (reading arguments, starting work) under `if __name__ == \"__main__\":`")


def _unpickling_failed(err: BaseException, where: str) -> str:
    """What to do about `err` raised by code that ran as the node was unpickled (not an import)."""
    ran = "unpickling it here raised"
    tb = err.__traceback__
    while tb is not None and tb.tb_frame.f_code is not loads.__code__:
        tb = tb.tb_next
    if tb is not None and tb.tb_next is not None:  # the frame loads called: the node's own unpickling code
        code = tb.tb_next.tb_frame.f_code
        ran = (f"unpickling it here ran {getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}, line "
               f"{tb.tb_next.tb_lineno}), which raised")
    return (f"{ran}: a {where} rebuilds each node from its pickled state, so what runs as it is unpickled "
            f"(`__setstate__`, a `__reduce__`'s function) runs there, in that process; make it work there, or "
            f"do that work in the node's `setup(self, ctx)`, which runs once per copy where it runs")


def _importing(err: BaseException):
    """(frame, line) of the innermost module-level code in `err`'s traceback (the module whose import raised),
    or (None, None) when the error did not come from running a module."""
    found = (None, None)
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "<module>":
            found = (tb.tb_frame, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _make_code(args: tuple, filename: str, lines: tuple | None):
    """Unpickling: the code object cloudpickle's arguments describe, under its real file name."""
    args = tuple(filename if _is_dynamic(a) else a for a in args)
    if lines:
        _remember_lines(filename, lines)
    return types.CodeType(*args)


def _is_dynamic(arg) -> bool:
    """Whether a code object's argument is cloudpickle's stand-in file name. Its bytes arguments (the bytecode)
    are not compared with a str: under `python -bb` (passed to workers too) that comparison raises."""
    return type(arg) is str and arg == _DYNAMIC


def _remember_lines(filename: str, lines: tuple) -> None:
    """Give `linecache` the shipped `(lineno, text)` pairs of a file that cannot be read here."""
    if os.path.isfile(filename):
        return  # the same file as the host's (Local runs on this machine): linecache reads it as usual
    import linecache  # here, not at the top: a worker that loads a node pays only for what it uses

    entry = linecache.cache.get(filename)
    known = list(entry[2]) if entry is not None and len(entry) == 4 else []
    for lineno, text in lines:
        known.extend("\n" for _ in range(lineno - len(known)))
        known[lineno - 1] = text
    # mtime None: checkcache() leaves the entry alone (as for source from a loader, or a notebook cell)
    linecache.cache[filename] = (sum(map(len, known)), None, known, filename)


def _file_name(f) -> str:
    name, mode = getattr(f, "name", None), getattr(f, "mode", None)
    return ", ".join(part for part in (repr(name) if name is not None else type(f).__name__,
                                       f"mode {mode!r}" if mode else "") if part)


_PICKLER = None


def _pickler_class():
    """cloudpickle's Pickler, with each by-value code object rebuilt by `_make_code` (the class is made once)."""
    global _PICKLER
    if _PICKLER is None:
        import linecache

        import cloudpickle

        base_reduce = cloudpickle.Pickler.dispatch_table.get(types.CodeType)

        class Pickler(cloudpickle.Pickler):
            def __init__(self, file):
                super().__init__(file)
                self.shipped: dict[str, set] = {}  # filename → line numbers already in this blob: each travels once

            def reducer_override(self, obj):
                if type(obj) is types.CodeType and base_reduce is not None:
                    return self.reduce_code(obj)
                if isinstance(obj, io.IOBase) and not isinstance(obj, (io.BytesIO, io.StringIO)):
                    # cloudpickle would send a file open for reading as a snapshot of its content: every
                    # copy of the node would read the same lines again. A file belongs to one process.
                    raise TypeError(f"it holds an open file ({_file_name(obj)}), which cannot be shared with "
                                    f"another process")
                return super().reducer_override(obj)

            def reduce_code(self, code):
                rebuild, args = base_reduce(code)
                if rebuild is not types.CodeType or not any(map(_is_dynamic, args)):
                    return rebuild, args  # a cloudpickle that keeps file names (or builds code otherwise)
                return _make_code, (args, code.co_filename, self.source_lines(code))

            def source_lines(self, code) -> tuple | None:
                """`(lineno, text)` for the lines `code` spans (its nested code objects ship their own)."""
                filename = code.co_filename
                shipped = self.shipped.setdefault(filename, set())
                numbers = {code.co_firstlineno} | {line for _, _, line in code.co_lines() if line}
                lines = []
                for lineno in sorted(numbers - shipped):
                    text = linecache.getline(filename, lineno)
                    if text:
                        lines.append((lineno, text))
                shipped |= numbers
                return tuple(lines) or None

        _PICKLER = Pickler
    return _PICKLER
