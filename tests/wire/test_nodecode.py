"""soma.wire.nodecode: a node defined in a script's `__main__` keeps its file name, line numbers and source lines.

One process defines the node in its `__main__` and dumps it (as the host does);
this process loads it (as a worker does), runs it, and reads the traceback.
"""

import subprocess
import sys
import traceback
from pathlib import Path

from soma.wire import nodecode
from tests.conftest import ROOT, wait_for  # noqa: E402

SCRIPT = '''\
import sys
from soma import Done, Node
from soma.wire import nodecode


class Boom(Node):
    def __init__(self):
        self.calls = 0

    def forward(self, x, ctx):
        self.calls += 1
        doubled = [v * 2 for v in x]
        raise ValueError(f"boom after {doubled}")


if __name__ == "__main__":
    with open(sys.argv[1], "wb") as f:
        f.write(nodecode.dumps(Boom()))
'''
RAISING_LINE = 13  # `raise ValueError(...)` above


def dump_from_main(tmp_path: Path, name: str) -> tuple[Path, bytes]:
    script, blob = tmp_path / name, tmp_path / f"{name}.blob"
    script.write_text(SCRIPT)
    subprocess.run([sys.executable, str(script), str(blob)], check=True, cwd=ROOT, timeout=60)
    return script, blob.read_bytes()


def traceback_of_forward(blob: bytes) -> str:
    node = nodecode.loads(blob)
    assert type(node).__name__ == "Boom" and node.calls == 0
    try:
        node.forward([1, 2], None)
    except ValueError as err:
        assert node.calls == 1
        return "".join(traceback.format_exception(err))
    raise AssertionError("forward did not raise")


def test_a_traceback_names_the_script_and_line_of_a_node_from_main(tmp_path):
    script, blob = dump_from_main(tmp_path, "my_pipeline.py")
    text = traceback_of_forward(blob)
    assert f'File "{script}", line {RAISING_LINE}, in forward' in text, text
    assert 'raise ValueError(f"boom after {doubled}")' in text, text
    assert "<dynamic-code>" not in text


def test_the_source_line_travels_with_the_code_when_the_file_is_not_there(tmp_path):
    script, blob = dump_from_main(tmp_path, "notebook_cell.py")
    script.unlink()  # a notebook cell, or a machine without the script: only the shipped lines can show it
    text = traceback_of_forward(blob)
    assert f'File "{script}", line {RAISING_LINE}, in forward' in text, text
    assert 'raise ValueError(f"boom after {doubled}")' in text, text


def test_a_node_from_an_importable_module_still_travels_by_reference():
    from tests.nodes import Tokenize

    blob = nodecode.dumps(Tokenize())
    assert b"tests.nodes" in blob and b"forward" not in blob  # the class by name, not its code
    assert type(nodecode.loads(blob)) is Tokenize


class _SaysWhetherLoading:
    """Unpickled: notes whether this thread is loading a node's code then, and waits until told to go on."""

    go = None  # a threading.Event, set by the test
    seen: list = []

    def __reduce__(self):
        return (_says_whether_loading, ())


def _says_whether_loading():
    from soma.wire import nodecode

    _SaysWhetherLoading.seen.append(nodecode.loading())
    _SaysWhetherLoading.go.wait(10)
    return _SaysWhetherLoading()


def test_loading_is_the_loading_threads_alone():
    """A pool is refused while its thread loads a node's code (a module's top level starting one: each worker
    would import it and start another); a node on another thread of that worker that starts a pool of its own
    meanwhile is not (a count for the whole process refused it)."""
    import pickle
    import threading

    _SaysWhetherLoading.go, _SaysWhetherLoading.seen = threading.Event(), []
    loader = threading.Thread(target=nodecode.loads, args=(pickle.dumps(_SaysWhetherLoading()),))
    loader.start()
    try:
        wait_for(lambda: _SaysWhetherLoading.seen, what="the load to begin")
        assert _SaysWhetherLoading.seen == [True]  # (on the loading thread)
        assert not nodecode.loading()  # (here, meanwhile)
    finally:
        _SaysWhetherLoading.go.set()
        loader.join(10)
    assert not nodecode.loading()
