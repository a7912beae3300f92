"""Synthetic training-step graphs for tests, docs and benchmarks.

Each builder makes a forward DAG, a loss, and the backward DAG of a training step: the
gradient node of forward node i reads the gradients of i's users (the loss, for the last
forward node) and the forward values backprop needs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from remat.errors import GraphError
from remat.graph import Graph, Node, NodeKind

MiB = 2**20


def training_graph(
    forward_deps: Sequence[Sequence[int]],
    forward_bytes: Sequence[int],
    forward_cost: Sequence[float],
    *,
    name: str,
    saved: Sequence[Sequence[int]] | None = None,
    param_grads: Sequence[int] = (),
    backward_cost_factor: float = 2.0,
    loss_bytes: int | None = None,
    fixed_bytes: int = 0,
) -> Graph:
    """Build the training step of a forward DAG.

    ``forward_deps[i]`` are the forward ids node i reads. ``saved[i]`` are the forward values
    the gradient of node i reads (default: i itself and its inputs). The last forward node
    feeds the loss. ``param_grads`` are forward ids whose gradient node is also a graph output
    (a parameter gradient, live until the end). A gradient node is as large as its forward node
    and costs ``backward_cost_factor`` times as much.
    """
    m = len(forward_deps)
    if not (len(forward_bytes) == len(forward_cost) == m) or m == 0:
        raise GraphError("forward_deps, forward_bytes and forward_cost must be non-empty and of equal length")
    nodes = [
        Node(f"f{i}", NodeKind.FORWARD, tuple(sorted(set(forward_deps[i]))), int(forward_bytes[i]), float(forward_cost[i]))
        for i in range(m)
    ]
    loss = m
    nodes.append(
        Node("loss", NodeKind.LOSS, (m - 1,), int(forward_bytes[m - 1] if loss_bytes is None else loss_bytes), float(forward_cost[m - 1]))
    )
    fwd_users: list[list[int]] = [[] for _ in range(m)]
    for i, deps in enumerate(forward_deps):
        for d in deps:
            fwd_users[d].append(i)
    grad_id = {}
    for k, i in enumerate(reversed(range(m))):
        grad_id[i] = m + 1 + k
    for i in reversed(range(m)):
        upstream = [grad_id[u] for u in fwd_users[i]] or [loss]
        if i == m - 1:
            upstream = sorted(set(upstream) | {loss})
        needs = list(saved[i]) if saved is not None else [i, *forward_deps[i]]
        deps = tuple(sorted(set(upstream) | set(needs)))
        nodes.append(
            Node(f"grad_f{i}", NodeKind.BACKWARD, deps, int(forward_bytes[i]), float(forward_cost[i]) * backward_cost_factor)
        )
    outputs = sorted({grad_id[i] for i in param_grads} | {grad_id[0]})
    return Graph(nodes=tuple(nodes), fixed_bytes=fixed_bytes, outputs=tuple(outputs), name=name)


def chain_graph(
    n_layers: int, *, bytes_per_node: int = MiB, cost_per_node: float = 1.0, fixed_bytes: int = 0
) -> Graph:
    """The linear training chain of the Checkmate paper: ``2n + 1`` nodes.

    Forward nodes ``0..n-1``, the loss ``n``, gradient nodes ``n+1..2n``. Every node reads the
    one before it, and gradient node ``2n - i`` also reads forward node ``i``. All nodes have
    the same size and cost. The final gradient (node ``2n``) is the output.

    >>> g = chain_graph(3, bytes_per_node=1)
    >>> g.n, g.nodes[6].deps
    (7, (0, 5))
    """
    if n_layers < 1:
        raise GraphError(f"chain_graph needs at least one layer, got n_layers={n_layers}")
    n = n_layers
    nodes = []
    for i in range(2 * n + 1):
        deps = {i - 1} if i > 0 else set()
        kind = NodeKind.FORWARD if i < n else NodeKind.LOSS if i == n else NodeKind.BACKWARD
        if i > n:
            deps.add(2 * n - i)
        label = f"f{i}" if i < n else "loss" if i == n else f"grad_f{2 * n - i}"
        nodes.append(Node(label, kind, tuple(sorted(deps)), int(bytes_per_node), float(cost_per_node)))
    return Graph(nodes=tuple(nodes), fixed_bytes=fixed_bytes, outputs=(2 * n,), name=f"chain{n}")


def unet_graph(depth: int, *, base_bytes: int = MiB, cost_per_node: float = 1.0, fixed_bytes: int = 0) -> Graph:
    """A U-Net-like training step: an encoder chain of ``depth + 1`` levels, a decoder that
    reads the level below and the encoder's skip connection at its own level, ``4*depth + 3``
    nodes. Level k's activations are ``base_bytes * 1024**((depth-k)/depth)`` (resolution
    halves while channels double, so deeper levels are smaller); compute costs are uniform.

    >>> unet_graph(2, base_bytes=1).n
    11
    """
    if depth < 1:
        raise GraphError(f"unet_graph needs depth >= 1, got depth={depth}")

    def level_bytes(k: int) -> int:
        return max(1, round(base_bytes * 1024 ** ((depth - k) / depth) / 1024))

    deps: list[list[int]] = []
    sizes: list[int] = []
    for k in range(depth + 1):  # encoder e_0..e_depth (e_depth is the bottleneck)
        deps.append([k - 1] if k > 0 else [])
        sizes.append(level_bytes(k))
    for k in reversed(range(depth)):  # decoder d_{depth-1}..d_0
        prev = len(deps) - 1
        deps.append([prev, k])
        sizes.append(level_bytes(k))
    m = len(deps)
    return training_graph(deps, sizes, [cost_per_node] * m, name=f"unet{depth}", fixed_bytes=fixed_bytes)


def random_training_graph(
    n_forward: int,
    seed: int,
    *,
    max_fan_in: int = 3,
    skip_probability: float = 0.3,
    max_bytes: int = 8,
    max_cost: int = 8,
    param_fraction: float = 0.3,
    bytes_unit: int = 1,
    fixed_bytes: int = 0,
) -> Graph:
    """A random training step of ``2 * n_forward + 1`` nodes (deterministic in ``seed``).

    The forward part is a random DAG with a backbone (node i reads i-1, so the last node
    depends on all) plus random skip edges; sizes and costs are random small integers; some
    gradient nodes are parameter-gradient outputs. Sizes are multiples of ``bytes_unit``.

    >>> random_training_graph(5, seed=1).n
    11
    """
    if n_forward < 1:
        raise GraphError(f"random_training_graph needs n_forward >= 1, got {n_forward}")
    rng = random.Random(seed)
    deps: list[list[int]] = []
    for i in range(n_forward):
        d = {i - 1} if i > 0 else set()
        for _ in range(max_fan_in - 1):
            if i > 1 and rng.random() < skip_probability:
                d.add(rng.randrange(0, i - 1))
        deps.append(sorted(d))
    sizes = [rng.randint(1, max_bytes) * bytes_unit for _ in range(n_forward)]
    costs = [float(rng.randint(1, max_cost)) for _ in range(n_forward)]
    params = [i for i in range(n_forward) if rng.random() < param_fraction]
    return training_graph(
        deps, sizes, costs, name=f"random{n_forward}s{seed}", param_grads=params, fixed_bytes=fixed_bytes
    )


def graph_from_spec(spec: str) -> Graph:
    """Parse a command-line graph name: ``chain:32``, ``unet:4``, ``random:60:7`` (size, seed).

    >>> graph_from_spec("chain:4").n
    9
    """
    parts = spec.split(":")
    kind, args = parts[0], parts[1:]
    usage = "use chain:N (layers), unet:D (depth) or random:N:SEED"
    try:
        nums = [int(a) for a in args]
    except ValueError:
        raise GraphError(f"graph {spec!r}: sizes must be integers; {usage}") from None
    if kind == "chain" and len(nums) == 1:
        return chain_graph(nums[0])
    if kind == "unet" and len(nums) == 1:
        return unet_graph(nums[0])
    if kind == "random" and len(nums) in (1, 2):
        return random_training_graph(nums[0], seed=nums[1] if len(nums) == 2 else 0, bytes_unit=MiB)
    raise GraphError(f"graph {spec!r} is not a built-in graph; {usage}")
