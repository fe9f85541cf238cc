"""Where a node's copies run on a Ray cluster: the pure half, which needs neither Ray nor a GPU.

    actor_options("encoder", "cuda:1", {"resources": {"gpu_box": 1}})
        → {"num_gpus": 1, "resources": {"gpu_box": 1},
           "runtime_env": {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}}
    cuda_visible_devices("encoder", 1, reserved=["2"], machine=["0", "1", "2", "3"])  → "0,2"
    hosting_error("encoder", "cuda:1", options, machines)  → a PlacementError, or None

Why the CUDA order is arranged by hand. Ray sets `CUDA_VISIBLE_DEVICES` in an actor to
the GPUs it reserved for it, so inside the actor they are renumbered from 0: a node
placed on `cuda:1` that was given physical GPU 2 would see it as `cuda:0`, and
`cuda:1` would not exist. soma tells Ray not to touch the variable
(`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`, through the actor's
runtime_env) and sets it itself, before the node's code is loaded and so before
torch can initialise CUDA, to an order in which index N *is* the reserved GPU.
The other positions are filled with the copy's other reserved GPUs, then the
machine's unreserved ones: they only make index N exist, and a node that obeys
its `ctx.device` never touches them.
"""

from __future__ import annotations

from ..device import Device
from ..errors import PlacementError

NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def cuda_index(device: str | None) -> int | None:
    """N for `cuda:N`, None for anything else (cpu, meta, unplaced)."""
    if device is None:
        return None
    parsed = Device.parse(device)
    return parsed.index if parsed.kind == "cuda" else None


def actor_options(node_id: str, device: str | None, extra: dict | None) -> dict:
    """The Ray actor options of one copy of a node: what its placement needs, then `options[id]` on top.

    A node on `cuda:N` holds one GPU (`num_gpus=1`) and asks Ray to leave
    `CUDA_VISIBLE_DEVICES` to soma. The user's options win, except that the
    user's `runtime_env` is merged with soma's environment variable rather than
    replacing it (their own variables win there too). A copy holds no CPU unless
    `num_cpus` is given, pinned or not (see the comment below).
    """
    options: dict = {}
    if cuda_index(device) is not None:
        options["num_gpus"] = 1
        options["runtime_env"] = {"env_vars": {NOSET_CUDA: "1"}}
    for key, value in (extra or {}).items():
        if key == "runtime_env" and "runtime_env" in options and isinstance(value, dict):
            merged = dict(value)
            merged["env_vars"] = {**options["runtime_env"]["env_vars"], **(value.get("env_vars") or {})}
            options["runtime_env"] = merged
        else:
            options[key] = value
    if "num_cpus" not in options and ("num_gpus" in options or "resources" in options):
        # Ray's trap: an actor that names no resource holds no CPU while it lives, but one that names any
        # (a GPU, a custom resource to pin it) holds a whole CPU unless told otherwise, so on a 1-CPU
        # machine a second pinned copy would wait forever. A copy holds a CPU only when options say so.
        options["num_cpus"] = 0
    return options


def checked_options(options) -> dict:
    """`soma.Ray(options=...)` as given: `{node id: {Ray actor option: value}}`, checked for shape only.

    The option names themselves are Ray's to judge, when the first copy is made.
    """
    if options is None:
        return {}
    if not isinstance(options, dict) or not all(isinstance(k, str) and isinstance(v, dict)
                                                for k, v in options.items()):
        raise TypeError("soma.Ray's options= maps node ids to dicts of Ray actor options, e.g. "
                        "{'encoder': {'num_gpus': 1, 'resources': {'gpu_box': 1}}}; got " + repr(options)[:200])
    return {k: dict(v) for k, v in options.items()}


def machine_gpus(visible: str | None, count: int) -> list[str]:
    """The GPU ids of one machine, in its order: its own `CUDA_VISIBLE_DEVICES` when set, else 0..count-1.

    Ray names reserved GPUs by the same ids (`ray.get_gpu_ids()` returns entries of the
    raylet's `CUDA_VISIBLE_DEVICES` when it was set, indices otherwise).
    """
    if visible is not None and visible.strip():
        return [part.strip() for part in visible.split(",") if part.strip()]
    return [str(i) for i in range(int(count))]


def cuda_visible_devices(node_id: str, index: int, reserved, machine) -> str | None:
    """The `CUDA_VISIBLE_DEVICES` under which `cuda:index` is the GPU Ray reserved for this copy.

    `reserved`: `ray.get_gpu_ids()` in the actor (Ray returns them in no particular
    order; they are taken in the machine's order). `machine`: every GPU id of the
    machine, in order (`machine_gpus`). None when nothing is reserved (the user gave
    `num_gpus=0`): the process's devices are then left as they are.
    A machine with fewer than index+1 GPUs cannot host `cuda:index`: `PlacementError`.
    """
    machine = [str(g) for g in machine]
    reserved = [str(g) for g in reserved]
    if len(machine) < index + 1:
        have = f"{len(machine)} GPU(s)" + (f" ({', '.join(machine)})" if machine else "")
        raise PlacementError(
            f"node `{node_id}` is placed on `cuda:{index}`, but the machine Ray chose for it has {have}: a machine "
            f"needs at least {index + 1} GPUs to have a `cuda:{index}`; pin the node to such machines with "
            f"options={{{node_id!r}: {{'resources': {{...}}}}}}, or place it on a lower index",
            node=node_id, devices=tuple(f"cuda:{i}" for i in range(len(machine))))
    if not reserved:
        return None
    position = {g: i for i, g in enumerate(machine)}
    reserved.sort(key=lambda g: position.get(g, len(machine)))
    primary, others_reserved = reserved[0], reserved[1:]
    fillers = others_reserved + [g for g in machine if g not in reserved]
    before = fillers[:index]
    after = [g for g in others_reserved if g not in before]
    return ",".join(before + [primary] + after)


def requested_resources(options: dict) -> dict:
    """What one copy asks Ray for, as resource totals a machine must have (CPU, GPU, memory, custom)."""
    wanted: dict = {}
    if options.get("num_cpus"):
        wanted["CPU"] = float(options["num_cpus"])
    if options.get("num_gpus"):
        wanted["GPU"] = float(options["num_gpus"])
    if options.get("memory"):
        wanted["memory"] = float(options["memory"])
    for name, amount in (options.get("resources") or {}).items():
        if amount:
            wanted[name] = float(amount)
    return wanted


def hosting_error(node_id: str, device: str | None, options: dict, machines: list[dict]) -> PlacementError | None:
    """Why no machine of the cluster can host a copy of this node, or None when one can.

    `machines`: the resource totals of each live machine (`ray.nodes()[i]["Resources"]`).
    Checked once, before the first copy is made: Ray would otherwise keep the
    actor pending, and the run waiting, forever.
    """
    wanted = requested_resources(options)
    index = cuda_index(device)
    if index is not None:
        wanted["GPU"] = max(wanted.get("GPU", 0.0), float(index + 1))
    for machine in machines:
        if all(machine.get(name, 0.0) >= amount for name, amount in wanted.items()):
            return None
    offered = "; ".join(_offer(m, wanted) for m in machines) or "none"
    if index is not None and not any(m.get("GPU", 0.0) >= index + 1 for m in machines):
        gpus = "a GPU" if index == 0 else f"{index + 1} GPUs"
        reason = (f"it is placed on `{device}`, but no machine of the Ray cluster has {gpus} (a machine with "
                  f"fewer has no `{device}`)")
    else:
        reason = f"no machine of the Ray cluster offers what it asks for ({_amounts(wanted)})"
    return PlacementError(f"node `{node_id}` cannot run: {reason}; the machines offer: {offered}; add a machine "
                          f"that has it to the cluster, or place the node elsewhere (`.on(...)`, its ray_options)",
                          node=node_id, devices=(device,) if device else ())


def demand_error(wanted_by_node: dict, machines: list[dict]) -> PlacementError | None:
    """Why the first copies of a graph's nodes cannot all be held at once, or None when they can.

    `wanted_by_node`: node id → `requested_resources` of one copy. Each node needs at
    least one copy alive at the same time as the others (a run goes through all of
    them), so their sum must fit in the cluster's totals: two nodes on `cuda:0` that
    each hold a whole GPU need two GPUs, or the second waits forever.
    """
    totals: dict = {}
    for machine in machines:
        for name, amount in machine.items():
            totals[name] = totals.get(name, 0.0) + amount
    needed: dict = {}
    for wanted in wanted_by_node.values():
        for name, amount in wanted.items():
            needed[name] = needed.get(name, 0.0) + amount
    short = sorted(name for name, amount in needed.items() if amount > totals.get(name, 0.0) + 1e-9)
    if not short:
        return None
    name = short[0]
    nodes = [node for node, wanted in wanted_by_node.items() if wanted.get(name)]
    each = ", ".join(f"`{node}` {wanted_by_node[node][name]:g}" for node in nodes)
    hint = (f"share it: options={{{nodes[0]!r}: {{'num_gpus': 0.5}}, ...}} (fractions of one GPU)" if name == "GPU"
            else "ask for less, or add machines")
    return PlacementError(
        f"the nodes of this graph together need {needed[name]:g} {name} at once ({each}), but the Ray cluster has "
        f"{totals.get(name, 0.0):g}: every node needs a copy alive for a run to pass through it; {hint}",
        node=nodes[0], devices=())


def _amounts(resources: dict) -> str:
    return ", ".join(f"{name}={amount:g}" for name, amount in sorted(resources.items()))


def _offer(machine: dict, wanted: dict) -> str:
    """One machine's totals of the resources that matter here (and its GPUs, which always matter)."""
    names = sorted(set(wanted) | {"GPU"})
    return "[" + _amounts({name: machine.get(name, 0.0) for name in names}) + "]"
