"""Running code right after a module has been imported, whoever imports it: the worker's torch set-up.

torch reads OMP_NUM_THREADS at import but caps it at the cores, and a node may
import torch inside its forward: only a hook on the import itself makes the very
first torch operation run with the threads the pool asked for.
"""

from __future__ import annotations

import sys


class AfterImport:
    """A meta-path finder that runs `then()` right after module `name` has been executed, once."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # find the real spec without us, and never again
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader:
    """The module's own loader, with `then()` after it has executed the module."""

    def __init__(self, loader, then):
        self.loader, self.then = loader, then

    def __getattr__(self, name):  # everything else (resource readers, is_package, ...) is the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.then()
