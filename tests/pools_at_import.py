"""A module whose top-level code starts a pool where it is imported by a worker or a Ray actor (not in the process
that runs the tests: tests/conftest.py's SOMA_TEST_HOST_PID): as a user's script without `if __name__ ==
"__main__":`, imported for its node class. soma refuses that pool (its workers would import this module and start
pools of their own, process after process): the node's NodeError says so. SOMA_TEST_POOL_DEPTH bounds the chain,
were soma ever not to refuse."""

import os

import soma
from soma import Done, Node


class InAModuleThatStartsAPool(Node):
    def forward(self, x, ctx):
        return Done(x + 1)


_depth = int(os.environ.get("SOMA_TEST_POOL_DEPTH", "0"))
if os.environ.get("SOMA_TEST_HOST_PID") != str(os.getpid()) and _depth < 2:
    os.environ["SOMA_TEST_POOL_DEPTH"] = str(_depth + 1)
    with soma.Local(workers=1, start_timeout=20) as _local:
        _local.run(InAModuleThatStartsAPool(), 0)
