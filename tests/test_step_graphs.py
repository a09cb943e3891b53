"""Device-resolved decode steps replayed as graphs (`DecodeRuntime(graphs=True)`,
`sparsetier/tools/step_graphs.py`). On a GPU they are CUDA graphs (the `cuda` cases, never
run yet). On the CPU (test builds with the host kernel) `testing.emulate_step_graphs` records
the resolver's launches at capture and replays them as recorded, the torch ops run eagerly
over the graph's fixed shapes: every step's outputs must be the resident run's, bit for bit,
through warm-ups, captures, replays, captures again after the resolver's buffers moved, and
replays the resolver refused; and nothing stays pinned."""

import pytest
import torch
from test_device_resolver import run_device_demo
from test_resolver_capture import DEVICES, on_cpu

from sparsetier import testing
from sparsetier.errors import ConfigError
from sparsetier.indexer import select_from_scores
from sparsetier.tools import demo
from sparsetier.tools.model import ModelConfig, TinySparseModel
from sparsetier.tools.runtime import DecodeRuntime


def _pair(device: str, selection: str, requests: int = 4):
    """A tiered runtime whose device-resolved steps are graphs (emulated on the CPU) and a
    resident one that plans on the host, the same requests admitted to both."""
    model = TinySparseModel(ModelConfig(layers=3, seed=5)).to(device)
    topk = 4 if selection == "block" else 24
    kw = dict(page_size=8, host_pages=300, indexer_pages=150, topk=topk, selection=selection)
    io = "cpu" if device == "cpu" else "kernel"
    cuda = device == "cuda"
    graphed = DecodeRuntime(
        model, device_slots=100, resolve="device", graphs=cuda, device=device, io_backend=io,
        **kw,
    )  # fmt: skip
    if not cuda:
        testing.emulate_step_graphs(graphed)
    ref = DecodeRuntime(model, device_slots=3000, device=device, io_backend=io, **kw)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (60 + 40 * i,), generator=g) for i in range(requests)]
    for rt in (graphed, ref):
        for rid, p in enumerate(prompts):
            rt.add_request(rid, p, 30 - 3 * rid)  # they end at different steps
    return graphed, ref


def _step_both(graphed: DecodeRuntime, ref: DecodeRuntime) -> None:
    a, b = graphed.step(), ref.step()
    assert a.failed == b.failed == []
    graphed.scheduler.validate()


def _finish_exact(graphed: DecodeRuntime, ref: DecodeRuntime) -> None:
    """Every request finished in both, with the same outputs bit for bit; nothing pinned."""
    for rid in sorted(graphed.requests):
        a, b = graphed.finish_request(rid), ref.finish_request(rid)
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert torch.equal(x, y), rid
    graphed.scheduler.end_step()
    graphed.drain()
    graphed.scheduler.validate()
    stats = graphed.scheduler.stats()
    assert (stats["pins"], stats["handles"]) == (0, 0), stats


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("selection", ["block", "token"])
def test_replayed_steps_are_the_resident_runs_bit_for_bit(device, selection):
    graphed, ref = _pair(device, selection)
    for _ in range(30):
        _step_both(graphed, ref)
    s = graphed.graphs.stats()
    # Requests end at different steps and histories cross buckets: several graphs, each
    # warmed up, captured and replayed.
    assert s["graphs"] >= 2 and s["captures"] >= s["graphs"], s
    assert s["replays"] >= 2 and s["refused"] == 0, s
    assert s["eager"] + s["captures"] + s["replays"] == graphed.scheduler.device_stats()["steps"]
    _finish_exact(graphed, ref)


def _replaying():
    """A CPU pair of three requests six steps in, its graphs replaying; and their stats."""
    graphed, ref = _pair("cpu", "block", requests=3)
    for _ in range(6):
        _step_both(graphed, ref)
    s0 = graphed.graphs.stats()
    assert s0["replays"] >= 1, s0
    return graphed, ref, s0


@on_cpu
def test_a_graph_is_captured_again_when_the_resolvers_buffers_move():
    graphed, ref, s0 = _replaying()
    # Room for more and wider requests: the buffers move, the epoch with them, and the next
    # step's launches would name the old ones: its graph is captured again.
    epoch = graphed.resolver.graph_epoch
    graphed.resolver.reserve(64, 8, 512)
    _step_both(graphed, ref)
    assert graphed.resolver.graph_epoch != epoch
    s1 = graphed.graphs.stats()
    assert s1["captures"] == s0["captures"] + 1 and s1["replays"] == s0["replays"], s1
    for _ in range(3):
        _step_both(graphed, ref)
    assert graphed.graphs.stats()["replays"] == s0["replays"] + 3
    _finish_exact(graphed, ref)


class _RefusingOnce:
    """The resolver, but its next `will_replay` is refused (as it refuses a replay it cannot
    account for), before anything changed."""

    def __init__(self, resolver) -> None:
        self._resolver, self.refusals = resolver, 1

    def will_replay(self, layers, rows=None):
        if self.refusals:
            self.refusals -= 1
            raise ConfigError.of("layers", str(list(layers)), "layers captured for this step")
        return self._resolver.will_replay(layers, rows)

    def __getattr__(self, name):
        return getattr(self._resolver, name)


@on_cpu
def test_a_refused_replay_runs_the_step_eagerly_and_the_next_captures_again():
    graphed, ref, s0 = _replaying()
    graphed.resolver = _RefusingOnce(graphed.resolver)
    _step_both(graphed, ref)
    s1 = graphed.graphs.stats()
    assert s1["refused"] == 1 and s1["eager"] == s0["eager"] + 1, s1
    _step_both(graphed, ref)
    s2 = graphed.graphs.stats()
    assert s2["captures"] == s1["captures"] + 1, s2
    for _ in range(3):
        _step_both(graphed, ref)
    _finish_exact(graphed, ref)


@on_cpu
@pytest.mark.parametrize(("selection", "faults"), [("block", True), ("token", False)])
def test_the_demo_with_step_graphs_is_exact(monkeypatch, selection, faults):
    cfg = demo.DemoConfig(
        requests=8, steps=24, selection=selection, faults=faults, resolve="device"
    )
    r, graphed = run_device_demo(monkeypatch, cfg, testing.emulate_step_graphs)
    t = r["totals"]
    gs = t["graph_steps"]
    assert gs["replays"] > 0 and gs["captures"] > 0, gs
    assert "step graphs" in demo.format_summary(r)
    assert graphed and all(rt.graphs.stats()["replays"] > 0 for rt in graphed)


def test_graphs_are_refused_where_they_cannot_run():
    model = TinySparseModel(ModelConfig(layers=2))
    kw = dict(page_size=8, device_slots=80, host_pages=40, indexer_pages=20, topk=3)
    with pytest.raises(ConfigError, match="graphs"):
        DecodeRuntime(model, resolve="device", graphs=True, **kw)  # on the CPU
    with pytest.raises(ConfigError, match="graphs"):
        DecodeRuntime(model, graphs=True, **kw)  # the host path plans every layer
    with pytest.raises(ConfigError, match="graphs"):
        demo.run_demo(demo.DemoConfig(requests=2, graphs=True, resolve="device"), progress=False)


def test_a_selection_does_not_depend_on_the_width_of_its_scores():
    # A graph scores a history bucket wider than the batch's: the entries past the queries'
    # positions must change nothing, ties included (ReLU scores are often exactly 0: they go
    # to the lower entry), nor where a short row's -1s are.
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([5, 59, 99, 139, 179])
    scores = torch.rand((5, 180), generator=g)
    scores[:, 20:90] = 0.0  # ties
    wide = torch.cat([scores, torch.rand((5, 332), generator=g)], dim=1)
    for mode, unit, k in (("block", 8, 4), ("token", 1, 24), ("block", 8, 30)):
        a = select_from_scores(scores, pos, mode=mode, unit=unit, topk=k, window=1)
        b = select_from_scores(wide, pos, mode=mode, unit=unit, topk=k, window=1)
        assert torch.equal(a, b), (mode, k)
        for row, p in zip(a, pos.tolist(), strict=True):
            kept = row[row >= 0]
            assert (row[: k - kept.numel()] == -1).all()  # -1s first
            assert bool((kept[1:] > kept[:-1]).all()) and int(kept.max()) <= p // unit
    # Ties go to the lower entry: the sink and the window, then the lowest zeros.
    flat = torch.zeros((1, 64))
    got = select_from_scores(flat, torch.tensor([63]), mode="token", unit=1, topk=5)
    assert got.tolist() == [[0, 1, 2, 3, 63]]


def test_graph_widths_are_powers_of_two_of_whole_pages():
    from sparsetier.tools.step_graphs import MIN_WIDTH, StepGraphs

    class Rt:
        ps, resolver = 16, object()

    sg = StepGraphs(Rt())
    assert sg.width(1) == MIN_WIDTH and sg.width(MIN_WIDTH) == MIN_WIDTH
    assert sg.width(MIN_WIDTH + 1) == 2 * MIN_WIDTH and sg.width(5000) == 8192
    assert all(sg.width(t) % 16 == 0 and sg.width(t) >= t for t in range(1, 3000, 7))
    with pytest.raises(ConfigError, match="graphs"):
        StepGraphs(type("NoResolver", (), {"resolver": None})())


def test_emulated_graphs_need_the_device_resolver():
    model = TinySparseModel(ModelConfig(layers=2))
    rt = DecodeRuntime(model, page_size=8, device_slots=80, host_pages=40, indexer_pages=20, topk=3)
    with pytest.raises(ConfigError, match="graphs"):
        testing.emulate_step_graphs(rt)
    assert rt.graphs is None
