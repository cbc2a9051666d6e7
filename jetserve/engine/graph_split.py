"""Many CUDA graphs from one stream capture: the steps are captured in turn into one graph, a one-byte memset marker
after each; each step's exec is then instantiated from a graph holding that step's nodes alone, made by halving
clones of the capture (`split_graph`). The CUDA driver API is reached through ctypes (`libcuda.so.1`, the library
torch itself runs on).

Why: on an H200 (docs/performance.md, session 33) every graph of a process replays 3-4% slower once the process has
made its fourth stream capture — captures count, not execs: four captured graphs of which one was instantiated slowed
it; one capture instantiated five times did not. The decode buckets captured one by one (eight at max_num_seqs 64)
put every engine there: batch 1 1.52 → 1.58 ms, batch 64 3.07 → 3.18 ms. From one capture, both replay at a lone
graph's speed (1.517 and 3.073 ms, the same tokens).

Segmenting: a single-stream capture is a chain in which each marker depends on every node enqueued before it, and
every node enqueued after it depends on it; in a topological order the nodes between marker i-1 and marker i are step
i's. `segment_nodes` checks that no edge joins two steps' nodes except through a marker.

Splitting (session 34, H200): a speculating engine at max_num_seqs 256 captures 20 decode graphs (5,772 nodes) and 56
speculative ones (23,777 nodes); a clone of the whole per step took 0.64 + 6.41 s to split them, halving 0.18 + 1.28 s.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Hashable
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

_P = ctypes.c_void_p
_SIZE = ctypes.c_size_t
_NODE_TYPE_MEMSET = 2  # CUgraphNodeType
_EDGE_DATA_BYTES = 8  # CUgraphEdgeData: from_port, to_port, type, reserved[5]
_SIGNATURES = {
    "cuMemsetD8Async": [ctypes.c_ulonglong, ctypes.c_ubyte, _SIZE, _P],
    "cuGraphGetNodes": [_P, ctypes.POINTER(_P), ctypes.POINTER(_SIZE)],
    "cuGraphGetEdges_v2": [_P, ctypes.POINTER(_P), ctypes.POINTER(_P), _P, ctypes.POINTER(_SIZE)],
    "cuGraphNodeGetType": [_P, ctypes.POINTER(ctypes.c_int)],
    "cuGraphMemsetNodeGetParams": [_P, _P],
    "cuGraphClone": [ctypes.POINTER(_P), _P],
    "cuGraphNodeFindInClone": [ctypes.POINTER(_P), _P, _P],
    "cuGraphDestroyNode": [_P],
    "cuGraphDestroy": [_P],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(_P), _P, ctypes.c_ulonglong],
    "cuGraphLaunch": [_P, _P],
    "cuGraphExecDestroy": [_P],
}


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_ulonglong), ("pitch", _SIZE), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", _SIZE), ("height", _SIZE)]  # fmt: skip


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """libcuda with the signatures set, or None (no driver library, or one without these entry points)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
    except (OSError, AttributeError):
        return None
    return lib


def available() -> bool:
    """Whether graphs can be split from one capture here: a CUDA (not ROCm) build of torch on a CUDA device, and a
    driver library with the graph entry points (CUDA 12.3+: edge data)."""
    return torch.cuda.is_available() and torch.version.hip is None and _driver() is not None


def _check(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed: CUresult {result}")


def segment_nodes(nodes: list[int], edges: list[tuple[int, int]], marker_index: dict[int, int]) -> dict[int, int]:
    """Each non-marker node's step (0, 1, ...) in a graph captured on one stream with marker `marker_index[n]`
    after step `marker_index[n]`; markers map to -1. Raises ValueError when the graph is not such a chain of steps:
    a cycle, markers out of order, a node after the last marker, or an edge between two steps' nodes."""
    successors: dict[int, list[int]] = defaultdict(list)
    in_degree = dict.fromkeys(nodes, 0)
    for a, b in edges:
        successors[a].append(b)
        in_degree[b] += 1
    order, ready = [], deque(n for n in nodes if in_degree[n] == 0)
    while ready:
        n = ready.popleft()
        order.append(n)
        for m in successors[n]:
            in_degree[m] -= 1
            if in_degree[m] == 0:
                ready.append(m)
    if len(order) != len(nodes):
        raise ValueError("the captured graph has a cycle")
    segment, step = {}, 0
    for n in order:
        if n in marker_index:
            if marker_index[n] != step:
                raise ValueError(f"marker {marker_index[n]} found where marker {step} was due")
            segment[n] = -1
            step += 1
        else:
            segment[n] = step
    if any(s == step for s in segment.values()):
        raise ValueError("nodes after the last marker")
    for a, b in edges:
        if segment[a] >= 0 and segment[b] >= 0 and segment[a] != segment[b]:
            raise ValueError(f"an edge joins step {segment[a]} and step {segment[b]} past their markers")
    return segment


class SplitGraph:
    """One step's exec, made from its graph (`split_graph`: a clone of the capture holding its nodes alone), which it
    owns; `replay()` launches it on the current stream. Holds the whole capture's torch graph (`keep_alive`): its
    memory pool backs the step's tensors."""

    def __init__(self, clone: _P, keep_alive: torch.cuda.CUDAGraph) -> None:
        self._clone, self._exec = _P(), _P()
        self.keep_alive = keep_alive
        result = _driver().cuGraphInstantiateWithFlags(ctypes.byref(self._exec), clone, 0)
        if result != 0:
            self._exec = _P()
            _driver().cuGraphDestroy(clone)
        _check(result, "cuGraphInstantiateWithFlags")
        self._clone = clone

    def replay(self) -> None:
        if self._exec.value is None:
            raise RuntimeError("replay of a split graph after its reset()")
        _check(_driver().cuGraphLaunch(self._exec, _P(torch.cuda.current_stream().cuda_stream)), "cuGraphLaunch")

    def reset(self) -> None:
        """Destroy the exec and its clone (as `torch.cuda.CUDAGraph.reset`); a later replay is an error."""
        lib = _driver()
        if self._exec.value is not None:
            lib.cuGraphExecDestroy(self._exec)
            self._exec = _P()
        if self._clone.value is not None:
            lib.cuGraphDestroy(self._clone)
            self._clone = _P()

    def __del__(self) -> None:
        try:
            self.reset()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone; nothing to free then
            pass


def capture_split(steps: list[tuple[Hashable, Callable[[], None]]], pool: object = None) -> tuple[dict, object]:
    """Capture `steps` ((key, step) pairs, each already run once outside a capture) in one stream capture into
    `pool`; returns ({key: SplitGraph}, the pool). Raises RuntimeError or ValueError when the driver refuses a call
    or the capture does not split (`segment_nodes`)."""
    lib = _driver()
    assert lib is not None, "graph_split.available() first"
    device = torch.cuda.current_device()
    markers = torch.zeros(len(steps), dtype=torch.uint8, device=device)  # [steps]: outside the pool, never read
    start = time.perf_counter()
    whole = torch.cuda.CUDAGraph(keep_graph=True)  # captured, never instantiated: the raw graph stays alive
    with torch.cuda.graph(whole, pool=pool):
        stream = _P(torch.cuda.current_stream().cuda_stream)
        for i, (_, step) in enumerate(steps):
            step()
            _check(lib.cuMemsetD8Async(markers.data_ptr() + i, 1, 1, stream), "cuMemsetD8Async")
    raw = _P(whole.raw_cuda_graph())
    captured = time.perf_counter()
    nodes, edges = _nodes_and_edges(lib, raw)
    marker_index = {}
    for n in nodes:
        kind = ctypes.c_int()
        _check(lib.cuGraphNodeGetType(_P(n), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == _NODE_TYPE_MEMSET:
            params = _MemsetParams()
            _check(lib.cuGraphMemsetNodeGetParams(_P(n), ctypes.byref(params)), "cuGraphMemsetNodeGetParams")
            if markers.data_ptr() <= params.dst < markers.data_ptr() + len(steps):
                marker_index[n] = params.dst - markers.data_ptr()
    if len(marker_index) != len(steps):
        raise ValueError(f"{len(marker_index)} of the {len(steps)} markers found in the captured graph")
    segment = segment_nodes(nodes, edges, marker_index)
    step_graphs = split_graph(_DriverOps(lib), raw, nodes, segment, len(steps))
    graphs = {}
    for i, (key, _) in enumerate(steps):
        try:
            graphs[key] = SplitGraph(step_graphs[i], whole)
        except RuntimeError:
            for g in step_graphs[i + 1 :]:
                lib.cuGraphDestroy(g)
            raise
    end = time.perf_counter()
    logger.info("%d graphs from one capture (%d nodes): captured in %.2f s, split in %.2f s", len(graphs), len(nodes),
                captured - start, end - captured)  # fmt: skip
    return graphs, whole.pool() if pool is None else pool


class GraphOps(Protocol):
    """What `split_graph` asks of the driver: graphs and nodes are opaque handles."""

    def clone(self, graph: object) -> object: ...
    def find_in_clone(self, node: object, clone: object) -> object: ...
    def destroy_node(self, node: object) -> None: ...
    def destroy_graph(self, graph: object) -> None: ...


def split_graph(ops: GraphOps, graph: object, nodes: list, segment: dict, num_steps: int) -> list:
    """A graph of its own per step (`segment`: `segment_nodes`' map of `nodes`, markers -1), cloned from `graph`
    (left as it is): a clone of the whole without the markers, then halved (a clone of each part, the other half's
    nodes destroyed in each) until each holds one step's nodes. Every node is looked up and destroyed once per halving,
    O(N log S) driver calls where a clone of the whole per step costs O(N S) (a speculating engine's ~25,000 nodes in
    ~56 graphs). The caller owns the returned graphs; on an error every clone made is destroyed."""
    made: list = []  # every clone alive, destroyed on an error
    try:
        root = ops.clone(graph)
        made.append(root)
        handles = {n: ops.find_in_clone(n, root) for n in nodes}  # original node → its copy in `root`
        for n in nodes:
            if segment[n] < 0:
                ops.destroy_node(handles.pop(n))
        result: list = [None] * num_steps
        todo = [(root, handles, 0, num_steps)]  # (graph holding steps lo..hi-1 alone, its node handles, lo, hi)
        while todo:
            part, handles, lo, hi = todo.pop()
            if hi - lo == 1:
                result[lo] = part
                continue
            mid = (lo + hi) // 2
            upper = ops.clone(part)
            made.append(upper)
            upper_handles = {}
            for n, h in handles.items():
                copy = ops.find_in_clone(h, upper)
                if segment[n] >= mid:
                    upper_handles[n] = copy
                    ops.destroy_node(h)
                else:
                    ops.destroy_node(copy)
            todo += [(part, {n: h for n, h in handles.items() if segment[n] < mid}, lo, mid),
                     (upper, upper_handles, mid, hi)]  # fmt: skip
        return result
    except BaseException:
        for g in made:
            ops.destroy_graph(g)
        raise


class _DriverOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def clone(self, graph: _P) -> _P:
        clone = _P()
        _check(self.lib.cuGraphClone(ctypes.byref(clone), graph), "cuGraphClone")
        return clone

    def find_in_clone(self, node: int | _P, clone: _P) -> _P:
        found, node = _P(), node if isinstance(node, _P) else _P(node)
        _check(self.lib.cuGraphNodeFindInClone(ctypes.byref(found), node, clone), "cuGraphNodeFindInClone")
        return found

    def destroy_node(self, node: _P) -> None:
        _check(self.lib.cuGraphDestroyNode(node), "cuGraphDestroyNode")

    def destroy_graph(self, graph: _P) -> None:
        self.lib.cuGraphDestroy(graph)


def _nodes_and_edges(lib: ctypes.CDLL, graph: _P) -> tuple[list[int], list[tuple[int, int]]]:
    count = _SIZE(0)
    _check(lib.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (_P * count.value)()
    _check(lib.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    num_edges = _SIZE(0)
    _check(lib.cuGraphGetEdges_v2(graph, None, None, None, ctypes.byref(num_edges)), "cuGraphGetEdges_v2")
    # The edge data must be asked for: without it the driver refuses a graph with programmatic (PDL) edges (402).
    src, dst = (_P * num_edges.value)(), (_P * num_edges.value)()
    data = (ctypes.c_ubyte * (_EDGE_DATA_BYTES * num_edges.value))()
    found = lib.cuGraphGetEdges_v2(graph, src, dst, ctypes.cast(data, _P), ctypes.byref(num_edges))
    _check(found, "cuGraphGetEdges_v2")
    return list(nodes), list(zip(src, dst, strict=True))
