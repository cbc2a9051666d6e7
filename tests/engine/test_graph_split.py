"""Many CUDA graphs from one stream capture (`engine.graph_split`): the segmentation of a captured chain by its
markers and the engine's choice between one capture and one per bucket, on the CPU; on a GPU, that each split exec
replays its own step and nothing of the others'."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from jetserve.engine import cuda_graph, graph_split
from jetserve.engine.graph_split import segment_nodes


def chain(*steps: int) -> tuple[list[int], list[tuple[int, int]], dict[int, int]]:
    """A single-stream capture: `steps[i]` nodes of step i in a chain, then step i's marker; node ids from 100."""
    nodes, edges, markers, prev = [], [], {}, None
    for i, count in enumerate(steps):
        for _ in range(count + 1):
            n = 100 + len(nodes)
            nodes.append(n)
            if prev is not None:
                edges.append((prev, n))
            prev = n
        markers[prev] = i
    return nodes, edges, markers


def test_a_chain_splits_at_its_markers_whatever_the_node_order():
    nodes, edges, markers = chain(2, 3, 1)
    random.Random(0).shuffle(nodes)
    random.Random(1).shuffle(edges)
    segment = segment_nodes(nodes, edges, markers)
    assert [segment[n] for n in sorted(segment)] == [0, 0, -1, 1, 1, 1, -1, 2, -1]


def test_a_fork_and_join_within_a_step_stays_in_it():
    # step 0: 100 → (101, 102) → 103, marker 104; step 1: 105, marker 106
    edges = [(100, 101), (100, 102), (101, 103), (102, 103), (103, 104), (104, 105), (105, 106)]
    segment = segment_nodes(list(range(100, 107)), edges, {104: 0, 106: 1})
    assert segment == {100: 0, 101: 0, 102: 0, 103: 0, 104: -1, 105: 1, 106: -1}


def test_an_empty_step_between_two_markers():
    nodes, edges, markers = chain(2, 0, 1)
    segment = segment_nodes(nodes, edges, markers)
    assert sorted(s for s in segment.values() if s >= 0) == [0, 0, 2]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("swap markers", "marker 1 found where marker 0 was due"),
        ("edge past a marker", "an edge joins step 0 and step 1"),
        ("node after the last marker", "nodes after the last marker"),
        ("cycle", "cycle"),
    ],
)
def test_what_is_not_a_chain_of_steps_is_refused(change, message):
    nodes, edges, markers = chain(2, 2)
    first, last = sorted(markers)
    if change == "swap markers":
        markers = {first: 1, last: 0}
    elif change == "edge past a marker":
        edges.append((nodes[0], nodes[4]))
    elif change == "node after the last marker":
        nodes.append(999)
        edges.append((last, 999))
    else:
        edges.append((nodes[4], nodes[1]))
    with pytest.raises(ValueError, match=message):
        segment_nodes(nodes, edges, markers)


def fake_captures(monkeypatch, split_result):
    """The engine's two capture paths replaced by recorders: `split_result` is what capture_split returns, or the
    exception it raises."""
    calls = {"split": [], "each": []}

    def capture_split(steps, pool):
        calls["split"].append([key for key, _ in steps])
        if isinstance(split_result, Exception):
            raise split_result
        return {key: f"split {key}" for key, _ in steps}, "split pool"

    def capture(key, graphs, pool, step):
        calls["each"].append(key)
        graphs[key] = f"own {key}"
        return "own pool"

    monkeypatch.setattr(graph_split, "available", lambda: True)
    monkeypatch.setattr(graph_split, "capture_split", capture_split)
    monkeypatch.setattr(cuda_graph, "_capture", capture)
    return calls


def steps_run(log: list) -> list:
    return [(B, lambda B=B: log.append(B)) for B in (4, 2, 1)]


def test_the_buckets_come_from_one_capture_when_the_driver_allows(monkeypatch):
    calls = fake_captures(monkeypatch, None)
    assert not cuda_graph._is_multi_rank()
    log, graphs = [], {}
    pool = cuda_graph._capture_all(steps_run(log), graphs, None)
    assert calls == {"split": [[4, 2, 1]], "each": []}
    assert log == [4, 2, 1]  # each step warmed up once before the capture
    assert graphs == {4: "split 4", 2: "split 2", 1: "split 1"} and pool == "split pool"


@pytest.mark.parametrize("why", ["turned off", "multi-rank", "refused"])
def test_one_capture_each_when_turned_off_multi_rank_or_refused(monkeypatch, caplog, why):
    calls = fake_captures(monkeypatch, RuntimeError("cuGraphClone failed: CUresult 1"))
    if why == "turned off":
        monkeypatch.setenv("JETSERVE_ONE_CAPTURE", "0")
    monkeypatch.setattr(cuda_graph, "_is_multi_rank", lambda: why == "multi-rank")
    graphs = {}
    with caplog.at_level(logging.WARNING, logger="jetserve.engine.cuda_graph"):
        pool = cuda_graph._capture_all(steps_run([]), graphs, None)
    assert calls["each"] == [4, 2, 1] and graphs == {4: "own 4", 2: "own 2", 1: "own 1"} and pool == "own pool"
    assert calls["split"] == ([[4, 2, 1]] if why == "refused" else [])
    assert ("capturing each on its own" in caplog.text) == (why == "refused")


class FakeOps:
    """Graphs as {node: the original node it copies}; a clone's nodes are found from its source graph's nodes only,
    and never after their destruction (as the driver's `cuGraphNodeFindInClone`)."""

    def __init__(self, nodes: list[int], fail_at: int | None = None) -> None:
        self.graphs = {0: {n: n for n in nodes}}  # graph → {node: original}
        self.source = {}  # clone → the graph it was cloned from, and its {source node: clone node}
        self.owner = {n: 0 for n in nodes}
        self.next_id, self.calls, self.fail_at = 1000, 0, fail_at

    def _call(self) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("cuGraphNodeFindInClone failed: CUresult 1")

    def clone(self, graph):
        self._call()
        g, copies = len(self.graphs), {}
        self.graphs[g] = {}
        for n, original in self.graphs[graph].items():
            copies[n] = self.next_id
            self.graphs[g][self.next_id] = original
            self.owner[self.next_id] = g
            self.next_id += 1
        self.source[g] = (graph, copies)
        return g

    def find_in_clone(self, node, clone):
        self._call()
        _, copies = self.source[clone]
        copy = copies[node]
        assert copy in self.graphs[clone], "a destroyed node looked up"
        return copy

    def destroy_node(self, node):
        self._call()
        del self.graphs[self.owner[node]][node]

    def destroy_graph(self, graph):
        del self.graphs[graph]


@pytest.mark.parametrize("steps", [[3], [2, 0, 4], [1] * 7, [5, 1, 0, 3] * 14])
def test_split_graph_gives_each_step_its_nodes_in_n_log_s_calls(steps):
    nodes, edges, markers = chain(*steps)
    segment = segment_nodes(nodes, edges, markers)
    ops = FakeOps(nodes)
    result = graph_split.split_graph(ops, 0, nodes, segment, len(steps))
    assert ops.graphs[0] == {n: n for n in nodes}  # the captured graph is left as it was
    for i, g in enumerate(result):
        assert sorted(ops.graphs[g].values()) == sorted(n for n in nodes if segment[n] == i), f"step {i}"
    assert sorted(ops.graphs) == sorted([0, *result])  # a clone per step, none left over
    levels = max(1, (len(steps) - 1).bit_length())
    assert ops.calls <= len(nodes) + len(markers) + 2 * len(nodes) * levels + len(steps)


@pytest.mark.parametrize("when", [0.0, 0.1, 0.5, 1.0])
def test_split_graph_destroys_its_clones_when_the_driver_refuses(when):
    nodes, edges, markers = chain(5, 1, 0, 3, 2, 2)
    clean = FakeOps(nodes)
    graph_split.split_graph(clean, 0, nodes, segment_nodes(nodes, edges, markers), 6)
    ops = FakeOps(nodes, fail_at=1 + round(when * (clean.calls - 1)))  # the first call, ..., the last
    with pytest.raises(RuntimeError, match="CUresult 1"):
        graph_split.split_graph(ops, 0, nodes, segment_nodes(nodes, edges, markers), 6)
    assert list(ops.graphs) == [0] and ops.graphs[0] == {n: n for n in nodes}


def test_bad_switch_value_is_an_error(monkeypatch):
    from jetserve import envs

    monkeypatch.setenv("JETSERVE_ONE_CAPTURE", "yes")
    with pytest.raises(ValueError, match="JETSERVE_ONE_CAPTURE"):
        envs.one_capture()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_each_split_graph_replays_its_own_step_only():
    """Three steps of different kernels (a torch add, a Triton RMSNorm with PDL, a cuBLAS GEMM) from one capture:
    replaying one exec runs its step on the current inputs and leaves the others' outputs alone."""
    from jetserve.ops.norm import rms_norm

    assert graph_split.available()
    x = torch.randn(8, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    a, b, c = (torch.zeros(8, 256, device="cuda") for _ in range(3))
    steps = [
        ("add", lambda: a.copy_(x + 1.0)),
        ("norm", lambda: b.copy_(rms_norm(x, w[0], 1e-6))),
        ("gemm", lambda: c.copy_(x @ w)),
    ]
    for _, step in steps:
        step()
    a.zero_(), b.zero_(), c.zero_()
    graphs, pool = graph_split.capture_split(steps)
    assert pool is not None and all(isinstance(g, graph_split.SplitGraph) for g in graphs.values())
    x.normal_()
    graphs["norm"].replay()
    torch.cuda.synchronize()
    assert torch.allclose(b, rms_norm(x, w[0], 1e-6)) and not a.any() and not c.any()
    graphs["gemm"].replay()
    graphs["add"].replay()
    torch.cuda.synchronize()
    assert torch.allclose(c, x @ w, rtol=1e-3, atol=1e-3) and torch.equal(a, x + 1.0)
    graphs["add"].reset()
    with pytest.raises(RuntimeError, match="after its reset"):
        graphs["add"].replay()
