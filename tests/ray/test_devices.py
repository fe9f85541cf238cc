"""soma.Ray's placement arithmetic, as pure functions: no Ray, no GPU needed (soma/ray/devices.py).

The CUDA order cannot be exercised for real on a machine without GPUs; these pin
down the mapping itself: `cuda:N` inside the actor must be the GPU Ray reserved.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from soma import PlacementError
from soma.ray.devices import (
    NOSET_CUDA,
    actor_options,
    checked_options,
    cuda_index,
    cuda_visible_devices,
    demand_error,
    hosting_error,
    machine_gpus,
    requested_resources,
)

ROOT = Path(__file__).resolve().parents[2]


# -- the CUDA order ----------------------------------------------------------------------------------

@pytest.mark.parametrize("device, index", [("cuda:0", 0), ("cuda:12", 12), ("cpu", None), ("meta", None),
                                           (None, None)])
def test_cuda_index_is_n_for_cuda_n_and_none_for_anything_else(device, index):
    assert cuda_index(device) == index


@pytest.mark.parametrize("index, reserved, machine, expected", [
    (0, ["2"], ["0", "1", "2", "3"], "2"),             # cuda:0 is the reserved GPU, nothing else is visible
    (1, ["2"], ["0", "1", "2", "3"], "0,2"),           # index 1 exists, and is physical 2
    (3, ["0"], ["0", "1", "2", "3"], "1,2,3,0"),       # the last index: every other GPU fills in before it
    (1, ["3", "1"], ["0", "1", "2", "3"], "3,1"),      # two reserved (Ray's order is none): the first by the
                                                       # machine's order at N, the other one fills in
    (0, ["1", "3"], ["0", "1", "2", "3"], "1,3"),      # ... or follows it
    (1, ["GPU-b"], ["GPU-a", "GPU-b"], "GPU-a,GPU-b"),  # a machine naming its GPUs by UUID
    (0, ["5"], ["4", "5", "6"], "5"),                   # the raylet's own CUDA_VISIBLE_DEVICES=4,5,6
])
def test_cuda_index_n_is_the_gpu_ray_reserved(index, reserved, machine, expected):
    order = cuda_visible_devices("encoder", index, reserved, machine)
    assert order == expected
    visible = order.split(",")
    assert visible[index] == sorted(reserved, key=machine.index)[0]  # what torch calls cuda:N
    assert len(set(visible)) == len(visible) and set(visible) <= set(machine)
    assert set(reserved) <= set(visible)


def test_a_machine_with_too_few_gpus_cannot_host_cuda_n():
    with pytest.raises(PlacementError) as caught:
        cuda_visible_devices("encoder", 2, ["0"], ["0", "1"])
    err = caught.value
    assert err.node == "encoder" and err.devices == ("cuda:0", "cuda:1")
    assert str(err).startswith("node `encoder` is placed on `cuda:2`, but the machine Ray chose for it has 2 GPU(s) "
                               "(0, 1): a machine needs at least 3 GPUs to have a `cuda:2`")


def test_nothing_reserved_leaves_the_devices_alone():
    assert cuda_visible_devices("encoder", 0, [], ["0", "1"]) is None  # options gave num_gpus=0


def test_machine_gpus_follow_the_raylets_own_visible_devices():
    assert machine_gpus(None, 3) == ["0", "1", "2"]
    assert machine_gpus("", 2) == ["0", "1"]
    assert machine_gpus("3, 1", 8) == ["3", "1"]
    assert machine_gpus(None, 0) == []


# -- actor options ------------------------------------------------------------------------------------

def test_a_cuda_node_holds_one_gpu_and_leaves_cuda_visible_devices_to_soma():
    assert actor_options("enc", "cuda:1", None) == {
        "num_gpus": 1, "num_cpus": 0, "runtime_env": {"env_vars": {NOSET_CUDA: "1"}}}


def test_cpu_meta_and_unplaced_nodes_ask_ray_for_nothing():
    for device in (None, "cpu", "meta"):
        assert actor_options("n", device, None) == {}


def test_user_options_win_and_runtime_envs_merge():
    options = actor_options("enc", "cuda:0", {
        "num_gpus": 0.5, "num_cpus": 2, "resources": {"gpu_box": 1}, "memory": 1 << 30,
        "runtime_env": {"pip": ["x"], "env_vars": {"A": "1"}}})
    assert options == {"num_gpus": 0.5, "num_cpus": 2, "resources": {"gpu_box": 1}, "memory": 1 << 30,
                       "runtime_env": {"pip": ["x"], "env_vars": {NOSET_CUDA: "1", "A": "1"}}}
    overridden = actor_options("enc", "cuda:0", {"runtime_env": {"env_vars": {NOSET_CUDA: "0"}}})
    assert overridden["runtime_env"]["env_vars"][NOSET_CUDA] == "0"  # theirs, if they insist


def test_a_pinned_copy_holds_no_cpu_unless_asked():
    assert actor_options("n", None, {"resources": {"host_a": 0.1}}) == {"resources": {"host_a": 0.1}, "num_cpus": 0}
    assert actor_options("n", None, {"resources": {"host_a": 1}, "num_cpus": 1})["num_cpus"] == 1
    assert "num_cpus" not in actor_options("n", None, {"max_restarts": 2})


def test_options_must_map_node_ids_to_dicts():
    assert checked_options(None) == {}
    assert checked_options({"a": {"num_cpus": 1}}) == {"a": {"num_cpus": 1}}
    for bad in ([("a", {})], {"a": 1}, {1: {}}):
        with pytest.raises(TypeError, match="options= maps node ids to dicts of Ray actor options"):
            checked_options(bad)


# -- can the cluster host it ---------------------------------------------------------------------------

MACHINES = [{"CPU": 8.0, "GPU": 2.0, "memory": 1e10}, {"CPU": 4.0, "host_b": 1.0}]


def test_requested_resources_count_what_a_machine_must_have():
    assert requested_resources({"num_cpus": 1, "num_gpus": 0.5, "memory": 100, "resources": {"x": 2, "y": 0}}) == {
        "CPU": 1.0, "GPU": 0.5, "memory": 100.0, "x": 2.0}
    assert requested_resources({}) == {}


def test_hosting_needs_one_machine_with_everything():
    assert hosting_error("a", "cuda:1", actor_options("a", "cuda:1", None), MACHINES) is None
    assert hosting_error("b", None, actor_options("b", None, {"resources": {"host_b": 0.1}}), MACHINES) is None
    both = actor_options("c", "cuda:0", {"resources": {"host_b": 1}})  # a GPU and host_b: no single machine
    err = hosting_error("c", "cuda:0", both, MACHINES)
    assert isinstance(err, PlacementError) and err.node == "c"
    assert str(err) == ("node `c` cannot run: no machine of the Ray cluster offers what it asks for (GPU=1, "
                        "host_b=1); the machines offer: [GPU=2, host_b=0]; [GPU=0, host_b=1]; add a machine that has "
                        "it to the cluster, or place the node elsewhere (`.on(...)`, its ray_options)")


def test_cuda_n_needs_a_machine_with_n_plus_one_gpus():
    err = hosting_error("enc", "cuda:2", actor_options("enc", "cuda:2", None), MACHINES)
    assert err.node == "enc" and err.devices == ("cuda:2",)
    assert str(err) == ("node `enc` cannot run: it is placed on `cuda:2`, but no machine of the Ray cluster has "
                        "3 GPUs (a machine with fewer has no `cuda:2`); the machines offer: [GPU=2]; [GPU=0]; add a "
                        "machine that has it to the cluster, or place the node elsewhere (`.on(...)`, its "
                        "ray_options)")
    err = hosting_error("enc", "cuda:0", actor_options("enc", "cuda:0", None), [{"GPU": 0.0}])
    assert "has a GPU (a machine with fewer has no `cuda:0`)" in str(err)
    fractional = actor_options("enc", "cuda:1", {"num_gpus": 0.25})
    assert hosting_error("enc", "cuda:1", fractional, MACHINES) is None  # a quarter of a GPU, index 1 exists


def test_a_graph_that_holds_more_than_the_cluster_has_is_refused():
    wanted = {n: requested_resources(actor_options(n, "cuda:0", None)) for n in ("enc", "dec", "head")}
    err = demand_error(wanted, MACHINES)
    assert err.node == "enc"
    assert str(err).startswith("the nodes of this graph together need 3 GPU at once (`enc` 1, `dec` 1, `head` 1), "
                               "but the Ray cluster has 2")
    assert "options={'enc': {'num_gpus': 0.5}, ...}" in str(err)
    shared = {n: requested_resources(actor_options(n, "cuda:0", {"num_gpus": 0.5})) for n in ("enc", "dec", "head")}
    assert demand_error(shared, MACHINES) is None


# -- the optional dependency ----------------------------------------------------------------------------

def test_without_ray_soma_ray_says_what_to_install_and_import_soma_never_imports_ray():
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if it were not installed: `import ray` raises ImportError\n"
        "import soma\n"
        "soma.Executor().run(soma.Graph.somatize(soma.fn(len)), [1])\n"
        "try:\n"
        "    soma.Ray()\n"
        "except soma.SomaError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "soma.Ray needs Ray, which is not installed here: pip install 'soma[ray]'"
    imported = subprocess.run([sys.executable, "-c", "import sys, soma; soma.Graph; soma.Local; soma.Executor;"
                               "print('ray' in sys.modules)"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert imported.stdout.strip() == "False", imported.stderr
