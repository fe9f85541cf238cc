"""The nodes a pool has seen: their keys, their pickled code, and which of them the host has let go.

A node's key is its identity for the pool: its code travels once per worker under
that key, and a node used by two graphs is one node with one state. Its code is
pickled once, when a graph that holds it is first compiled for this pool: every
copy is made from the node as it was then (and a node that cannot be pickled is
an error before anything is sent). When the host's node object is garbage
collected no graph can run it again, so its key is queued for the workers to
forget.

What a node's code reads from outside the node (a module global, a closure's
variable) travels with it as it was then too, or is imported afresh by the worker:
a copy does not see the host rebind it later, where the in-process Executor does.
So when a node is pickled, `Reads` notes what its code reads, cheaply (which
object each name is bound to); `warn_if_changed`, called by a copying runner (Local,
Ray) as it accepts each run or map, warns once per node when one of those names
now names another object, or the node's code (its module, imported by each worker
once) changed on disk, or the weights of a torch module it holds changed in place:

    code(node) ─ pickled ─▶ _sent.put(node, Reads(node))     the names its code reads, and the id (or the
                                                             small value) each is bound to
    Local.run(g, x) ─ accepting ─▶ warn_if_changed(g)        reads.changed(): warnings.warn, once per node,
                                                             naming it and what changed
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import sys
import threading
import time
import types
import warnings
import weakref
from collections import deque

from ..errors import NodeError
from .codefiles import CodeFiles, Look, SentFiles
from .identity import ByNode
from .weights import Weights

LOOK_EVERY_S = 1.0  # between two looks at a graph's weights and code files on a run's way (a map's start looks)


class NodeRegistry:
    def __init__(self, shared_workers: bool = False):
        self._lock = threading.Lock()
        # (Local: every node's copies share the workers, which import a module once: `SentFiles`)
        self.files = SentFiles() if shared_workers else None
        self._key_by_id: dict[int, int] = {}  # id(node) → key
        self._entries: dict[int, list] = {}  # key → [ref to the node, pickled code or None, id(node)]
        self._keys = itertools.count(1)
        self.dead: deque = deque()  # keys of nodes gone on the host, until `take_dead` (read as a flag on a run's way)

    def key_of(self, node) -> int:
        with self._lock:
            key = self._key_by_id.get(id(node))
            if key is not None and self._entries[key][0]() is node:
                return key
            key = next(self._keys)
            try:
                ref = weakref.ref(node, lambda _, key=key: self.dead.append(key))
            except TypeError:  # a node without __weakref__: keep it alive as long as the pool
                ref = (lambda n: (lambda: n))(node)
            self._key_by_id[id(node)] = key
            self._entries[key] = [ref, None, id(node)]
            return key

    def code(self, node_id: str, key: int) -> bytes:
        """The node's code, pickled once (`soma.wire.nodecode`: classes from `__main__` and notebooks travel too,
        with their file names and lines)."""
        entry = self._entries[key]
        if entry[1] is None:
            from ..wire import nodecode

            node = entry[0]()
            try:
                entry[1] = nodecode.dumps(node)
            except Exception as err:
                raise NodeError.failed(node_id, f"it cannot be sent to a worker: {type(err).__name__}: {err} (keep "
                                                f"unpicklable things such as locks, sockets and open files out of "
                                                f"the node, or create them in setup)") from err
            reads = note_sent(node)
            if self.files is not None and reads is not None and reads.files is not None:
                stale = self.files.sent(reads.files)
                if stale:
                    reads.warned = True
                    _warn_code_changed(node_id, stale, "this pool's workers, where the node's copies run, imported "
                                                       "it for a node sent before (a reload in this process does "
                                                       "not reach them)")
        return entry[1]

    def take_dead(self) -> list[int]:
        """Keys of nodes the host has let go since the last call; their code is dropped here."""
        dead = []
        while self.dead:
            try:
                dead.append(self.dead.popleft())
            except IndexError:
                break
        if dead:
            with self._lock:
                for key in dead:
                    entry = self._entries.pop(key, None)
                    if entry is not None and self._key_by_id.get(entry[2]) == key:
                        del self._key_by_id[entry[2]]
        return dead


# -- what a node's code reads from outside it --------------------------------------------------------------

_sent = ByNode()  # node → its Reads when it was last pickled
_CALLED = ("forward", "forward_batch", "setup")  # a Node class's methods whose reads are noted
_KEPT = (int, float, complex, str, bytes, bool, type(None))  # compared by value (an equal int rebound is no change)
# Not followed: modules, classes and builtins (`torch`, `Done`, `len`) are not rebound in practice, and leaving
# them out leaves most nodes nothing to look at on each call
_FIXED = (types.ModuleType, type, types.BuiltinFunctionType)


class Reads:
    """The module globals (but modules, classes and builtins) and closure variables a node's own code reads (a
    soma.fn node's function; its class's forward, forward_batch and setup; their nested code too), and what
    each was bound to when noted: the value
    itself for numbers, strings and None, else the object's id (no reference kept: a tensor is not held alive).
    Found once, when the node is pickled; `changed()` only reads each name again (~1 µs for a few)."""

    __slots__ = ("names", "sources", "then", "weights", "files", "warned", "noted_at")

    def __init__(self, node):
        names, sources = [], []
        functions = _functions_of(node)
        for func in functions:
            scope = func.__globals__
            for name in _global_names(func.__code__):
                if name in scope and not isinstance(scope[name], _FIXED):
                    names.append(name)
                    sources.append((scope, name))
            for name, cell in zip(func.__code__.co_freevars, func.__closure__ or ()):
                names.append(name)
                sources.append((cell, None))
        self.names, self.sources = tuple(names), tuple(sources)
        self.then = self._now()
        # the torch modules it holds or reads, whose weights its copies keep (soma.run.weights)
        self.weights = Weights.of(node, [_read(source, name) for source, name in sources])
        # the files of its code that workers import (not __main__'s): its functions', its classes' modules
        self.files = CodeFiles.of(functions, _classes_of(node, self.weights))
        self.warned = False  # its node was warned about (once each, until it is sent again)
        self.noted_at = time.monotonic()  # when its weights and files were noted (looked at, in effect)

    def _now(self) -> tuple:
        return tuple(_bound(_read(source, name)) for source, name in self.sources)

    def changed(self) -> list[str]:
        """The names bound to another value than when noted."""
        now = self._now()
        if now == self.then:
            return []
        return sorted({name for name, a, b in zip(self.names, self.then, now) if a != b})


_GONE = object()  # a global deleted since, or a closure cell emptied


def _read(source, name):
    if name is None:
        try:
            return source.cell_contents
        except ValueError:
            return _GONE
    return source.get(name, _GONE)


def _bound(value):
    return ("value", value) if type(value) in _KEPT else ("id", id(value))


def note_sent(node) -> "Reads | None":
    """`node` is being pickled for its copies: what its code reads now is what they see. Its Reads (None for a
    node without __weakref__: not followed)."""
    reads = _sent.get(node)
    if reads is None:
        try:
            reads = Reads(node)
            _sent.put(node, reads)
        except TypeError:  # a node without __weakref__: not followed
            return None
    else:  # pickled again (another pool): the graphs that hold it keep this one Reads
        reads.then = reads._now()
        if reads.weights is not None:
            reads.weights.noted()
        if reads.files is not None:
            reads.files.noted()
        reads.warned = False
        reads.noted_at = time.monotonic()
    return reads


_last_read: tuple = (lambda: None, [], [], [0.0])  # (a weak reference to the graph run last, its lists: _by_graph)
_by_graph: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph → (reading, looking, looked): _reading


def warn_if_changed(graph, thorough: bool = False, files: SentFiles | None = None) -> None:
    """Warn, once per node, when something a node's code reads from outside it names another object than when
    the node was sent to its copies (the copies still see the old one; looked at on every call, ~1 µs for a few
    names), or the weights of a torch module it holds or reads changed in place (`soma.run.weights`), or its
    code's files changed on disk (`soma.run.codefiles`): weights and files are looked at on one clock a graph,
    every LOOK_EVERY_S on a run's way and at each map's start (`thorough`). A graph's lists of what to look at
    are made once all its nodes have been sent: a graph whose nodes read nothing and hold nothing to look at
    costs one lookup a call, and one clock reading when they do. `files`: the asking pool's (Local's), whose
    workers may have imported code files in versions other than the one noted when a node was last sent (to
    another pool, say)."""
    global _last_read
    last_graph, reading, looking, looked = _last_read  # (one tuple: read whole, never half of two threads' writes)
    if last_graph() is not graph:  # (the graph run last is looked up without a new weak reference)
        lists = _by_graph.get(graph)
        if lists is None:
            lists = _reading(graph)
        reading, looking, looked = lists
        if lists is _by_graph.get(graph):  # (made for good: every node has been sent)
            _last_read = (weakref.ref(graph), reading, looking, looked)
    for node_id, reads in reading:
        if reads.warned or reads._now() == reads.then:
            continue
        reads.warned = True
        names = ", ".join(f"`{name}`" for name in reads.changed())
        _warn(node_id, f"reads {names}, which now names another value than when the node was sent to its copies "
                       f"on worker processes: they still see the old one",
              "the new value, give it to a new node as its attribute, or pass it in the input")
    if looking:  # (each graph's own clock: one graph run after another, the second's were never looked at)
        now = time.monotonic()
        if thorough or now - looked[0] >= LOOK_EVERY_S:
            looked[0] = now
            _warn_if_weights_or_code_changed(looking, files)


def _warn_if_weights_or_code_changed(looking: list, files: SentFiles | None) -> None:
    look = Look()  # (each file read once a look, however many nodes share it)
    for node_id, reads in looking:
        if reads.warned:
            continue
        what = reads.weights.changed() if reads.weights is not None else None
        if what == "weights":
            _warn(node_id, "holds a torch module whose weights changed in place (an optimizer step, "
                           "load_state_dict) since the node was sent to its copies on worker processes: they still "
                           "run the old weights",
                  "the new weights, make a new node of the module (soma.torch.Module(model)), or start a new pool")
        elif what == "mode":
            _warn(node_id, "holds a torch module switched between train and eval mode (`model.eval()`, "
                           "`model.train()`) since the node was sent to its copies on worker processes: they still "
                           "run it in the mode it had then (dropout, batch norm)",
                  "the new mode, make a new node of the module (soma.torch.Module(model)), or set the mode before "
                  "its first run")
        elif reads.files is not None and (edited := reads.files.changed(look, files)):
            _warn_code_changed(node_id, edited, "the node was sent to its copies on worker processes")
        else:
            continue
        reads.warned = True


def _warn_code_changed(node_id: str, edited: list, since: str) -> None:
    warnings.warn(f"node `{node_id}` runs code of {', '.join(edited)}, which changed on disk since {since}: those "
                  f"run the code as their worker imported it, and a worker that imports it from now on (one that had "
                  f"not run the node yet, or a replacement) imports the new, so the pool may run both (docs/api.md, "
                  f"\"Copies\"); to run the new code, start a new pool", UserWarning, stacklevel=_outside_soma())


def _warn(node_id: str, said: str, fix: str) -> None:
    warnings.warn(f"node `{node_id}` {said}, where the in-process Executor sees the new (docs/api.md, \"Copies\"); "
                  f"to use {fix}", UserWarning, stacklevel=_outside_soma())


_SOMA = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # soma's own files start so


def _outside_soma() -> int:
    """The stacklevel (for its caller's warnings.warn) of the first frame outside soma: the line that called run,
    map, submit, arun or amap, however many of soma's own calls lie between."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_SOMA):
        frame, level = frame.f_back, level + 1
    return level


def _reading(graph) -> tuple:
    """`(reading, looking, looked)`: `[(node id, Reads)]` of the graph's nodes whose code reads names from
    outside, and of those that hold a torch module or whose code's files are watched, and when the graph's
    weights and files were last looked at (in a list: set in place); kept once every node has been sent."""
    reading, looking, complete = [], [], True
    for node_id in graph.nodes():
        node = graph.node(node_id)
        reads = _sent.get(node)
        if reads is None:
            try:
                weakref.ref(node)
            except TypeError:  # a node without __weakref__ is never followed: nothing to wait for
                continue
            complete = False
        else:
            if reads.sources:
                reading.append((node_id, reads))
            if reads.weights is not None or reads.files is not None:
                looking.append((node_id, reads))
    # (when last looked at: as they were sent; not as these lists are made, at the run after: a file edited
    # between the run that sent them and the next was seen a second after that one, by a third run)
    lists = (reading, looking, [min((reads.noted_at for _, reads in looking), default=0.0)])
    if complete:
        _by_graph[graph] = lists
    return lists


def _functions_of(node) -> list:
    """The node's own code: a soma.fn node's function (its `func`, through functools.partial and decorators
    that say what they wrap), and its class's forward, forward_batch and setup; soma's own functions left out."""
    kind = type(node)
    found = [_unwrapped(getattr(node, "__dict__", {}).get("func"))] + [getattr(kind, name, None) for name in _CALLED]
    return [f for f in found if type(f) is types.FunctionType and not f.__module__.startswith("soma.")]


def _unwrapped(func):
    while isinstance(func, functools.partial):
        func = func.func
    try:
        return inspect.unwrap(func) if callable(func) else func
    except ValueError:  # (a cycle of __wrapped__)
        return func


def _classes_of(node, weights) -> list:
    """The classes whose modules hold the node's code beyond the functions above: its class and its bases (a
    forward inherited from another file calling a method of this one), a soma.fn node's callable object's, and
    those of the torch modules it holds, their submodules' included (`soma.torch.Module(Model())`: Model's);
    soma's own left out (and, by CodeFiles, torch's and every library's)."""
    found = [*type(node).__mro__, *type(_unwrapped(getattr(node, "__dict__", {}).get("func"))).__mro__]
    for ref in weights.modules if weights is not None else ():
        module = ref()
        if module is not None:
            found += [c for sub in module.modules() for c in type(sub).__mro__]
    return [c for c in dict.fromkeys(found) if c.__module__ != "soma" and not c.__module__.startswith("soma.")
            and c.__module__ != "builtins"]


def _global_names(code) -> set:
    """The names `code` and the code nested in it (comprehensions, lambdas, inner functions) read."""
    found, todo = set(), [code]
    while todo:
        each = todo.pop()
        found.update(each.co_names)
        todo.extend(c for c in each.co_consts if isinstance(c, types.CodeType))
    return found
