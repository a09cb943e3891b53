"""The device resolver's launches captured once and replayed in later steps, as a CUDA graph
does: `resolve` under capture, `graph_epoch`, `will_replay`. On a GPU the launches are captured
in torch CUDA graphs, one a layer (as piecewise graphs capture them). On the CPU the kernel's
source records a launch's arguments by value and replays them as they are
(`_record_launches`, `_replay_recorded`), so a launch argument that changed between steps
without the epoch changing replays stale buffers here as it would on a GPU (where it would
read freed memory; here the device refuses it). A stack that replays runs beside a twin that
launches each layer, on the same selections: every selected cell of every layer must find its
page's rows as the model wrote them, both stacks `validate()` (in test builds, the device's
mirror and the bytes of every object against their host copies), and nothing stays pinned."""

import numpy as np
import pytest
import torch

import sparsetier as sp
from sparsetier import _core, testing
from sparsetier.errors import ConfigError, CudaError, OutOfRangeError

HOST_KERNEL = hasattr(_core.DeviceResolver, "_record_launches") and hasattr(
    _core.DeviceResolver, "_use_host_kernel"
)
GPU = torch.cuda.is_available() and sp.cuda_status()[0]
on_cpu = pytest.mark.skipif(
    not HOST_KERNEL, reason="needs a build with the testing and host-kernel features (make build)"
)
DEVICES = [
    pytest.param("cpu", marks=on_cpu),
    pytest.param("cuda", marks=pytest.mark.skipif(not GPU, reason="no usable CUDA GPU here")),
]

PS, LAYERS, DIM = 8, 4, 8


class Stack:
    """A joined scheduler whose resolver runs the kernel (on CUDA pools, or on one CPU thread),
    every request admitted and prefilled with random rows (the same in two stacks of the
    same seed); `truth` keeps what the model wrote of each (request, layer, page)."""

    def __init__(self, lens, device="cpu", seed=3, kernel=True, more_pages=0, device_pages=96):
        self.cuda = device == "cuda"
        pages = sum(-(-n // PS) + 8 for n in lens) + 16 + more_pages
        kv = _core.PoolSpec("KV", 1, 1, DIM, "bf16", PS, device_pages)
        kv_host = _core.PoolSpec("KV", LAYERS, 1, DIM, "bf16", PS, pages)
        ik = _core.PoolSpec("INDEXER", LAYERS, 1, 1, "bf16", PS, pages)

        def host(spec):
            t = torch.zeros(spec.shape(), dtype=torch.bfloat16)
            return t.pin_memory() if self.cuda else t

        self.dev = torch.zeros(kv.shape(), dtype=torch.bfloat16, device=device)
        host_kv, ihost = host(kv_host), host(ik)
        idev = torch.zeros(ik.shape(), dtype=torch.bfloat16, device=device)
        self.tensors = (host_kv, idev, ihost)
        self.s = _core.StepScheduler.joined(
            _core.PageTransferBinding(self.dev, kv),
            _core.PageTransferBinding(host_kv, kv_host),
            _core.TransferEngine("kernel") if self.cuda else _core.TransferEngine("cpu", threads=1),
            indexer_device=_core.PageTransferBinding(idev, ik),
            indexer_host=_core.PageTransferBinding(ihost, ik),
            prefetch=False,
        )
        self.res = self.s.enable_device_resolver()
        self.g = torch.Generator().manual_seed(seed)
        self.lens, self.truth = {}, {}
        for rid, n in enumerate(lens):
            self.admit(rid, n)
        if kernel and not self.cuda:
            testing.use_host_kernel(self.res, 1)

    def sel(self, sel: np.ndarray):
        """A selection as the resolver takes it here: int32, on the pools' device."""
        return torch.from_numpy(sel).to(self.dev.device) if self.cuda else sel

    def resolve(self, layer: int, rids: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """One layer launched now; its table on the host."""
        return _host(self.res.resolve(layer, rids, self.sel(sel)))

    def admit(self, rid: int, n: int) -> None:
        toks = np.arange(rid * 100_000, rid * 100_000 + n, dtype=np.int64)
        self.s.admit(rid, toks)
        self.truth[rid] = [{} for _ in range(LAYERS)]
        for at in range(0, n, 8 * PS):
            first, slots = self.s.extend(rid, min(8 * PS, n - at))
            # The model's rows: random, written where the chunk's pages lie, then written
            # through to host; `truth` keeps each (layer, page)'s.
            for li in range(LAYERS):
                for p, s in enumerate(slots[li]):
                    rows = torch.randn((2, PS, 1, DIM), generator=self.g).to(self.dev.dtype)
                    self.dev[:, 0, int(s)] = rows.to(self.dev.device)
                    self.truth[rid][li][first + p] = rows
            self.s.end_step()
        self.s.drain()
        self.lens[rid] = n

    def check(self, rids: np.ndarray, sel: np.ndarray, layer: int, table: np.ndarray) -> None:
        """Every selected cell's slot holds its page's rows at `layer`, as the model wrote
        them."""
        for b, r in enumerate(rids):
            for c, page in enumerate(sel[b]):
                if page < 0:
                    continue
                n = min(PS, self.lens[int(r)] - int(page) * PS)  # the rows written
                got = self.dev[:, 0, int(table[b, c]), :n].cpu()
                want = self.truth[int(r)][layer][int(page)][:, :n]
                assert torch.equal(got, want), (int(r), layer, int(page), int(table[b, c]))


def _host(table) -> np.ndarray:
    return table.cpu().numpy() if isinstance(table, torch.Tensor) else table


def _selections(stack: Stack, rids: np.ndarray, k: int, steps: int, seed: int = 7):
    """`steps` of each layer's block selections for `rids`: half of each row kept a step."""
    rng = np.random.default_rng(seed)
    cur = None
    for _ in range(steps):
        pages = [-(-stack.lens[int(r)] // PS) for r in rids]
        sel = np.full((LAYERS, len(rids), k), -1, dtype=np.int32)
        for li in range(LAYERS):
            for b, n in enumerate(pages):
                pick = rng.choice(n, size=min(k, n), replace=False)
                if cur is not None and cur.shape[1] == len(rids):
                    keep = cur[li, b][cur[li, b] >= 0][: k // 2]
                    pick = np.concatenate([keep, pick[~np.isin(pick, keep)]])[: min(k, n)]
                sel[li, b, : len(pick)] = pick
        cur = sel
        yield sel


def _step(st: Stack, rids: np.ndarray, k: int) -> None:
    slots, rows = st.s.append(rids)
    # The step's new token rows, as the model writes them (the same in stacks of one seed).
    for b, r in enumerate(rids):
        page = st.lens[int(r)] // PS
        st.lens[int(r)] += 1
        for li in range(LAYERS):
            row = torch.randn((2, 1, DIM), generator=st.g).to(st.dev.dtype)
            st.dev[:, 0, int(slots[b, li]), int(rows[b])] = row.to(st.dev.device)
            if int(rows[b]) == 0:
                st.truth[int(r)][li][page] = torch.zeros((2, PS, 1, DIM), dtype=st.dev.dtype)
            st.truth[int(r)][li][page][:, int(rows[b])] = row
    assert st.s.begin_device_step(rids, k)


def _ends_clean(rids: np.ndarray, *stacks: Stack) -> None:
    """Every request finished: the checks hold, and nothing stays pinned or held."""
    for st in stacks:
        for rid in rids:
            st.s.finish_request(int(rid))
        st.s.end_step()
        st.s.drain()
        st.s.validate()
        stats = st.s.stats()
        assert (stats["pins"], stats["handles"]) == (0, 0), stats


def _record(rec) -> dict:
    # (What each loads depends on which slots each granted: the two stacks' transfer
    # threads finish in their own order, so their LRUs differ.)
    return {k: rec[k] for k in ("requests", "layers", "selected", "pages")}


class Graphs:
    """A step's layers captured over fixed selection buffers, and their replays: torch CUDA
    graphs on a GPU (one a layer), the recorded launches on the CPU. The tables the launches
    write are kept here, as a graph's output buffers are."""

    def __init__(self, st: Stack, rids: np.ndarray, sel: np.ndarray, layers=range(LAYERS)):
        self.st, self.rows = st, sel.shape[1]
        self.bufs = {li: st.sel(np.ascontiguousarray(sel[li])) for li in range(LAYERS)}
        self.graphs, self.tables = {}, {}
        for li in layers:
            self.capture(li, rids)

    def capture(self, li: int, rids: np.ndarray) -> None:
        st = self.st
        if st.cuda:
            self.graphs[li] = torch.cuda.CUDAGraph()
            # (thread_local: the transfer engine's threads may call CUDA meanwhile.)
            with torch.cuda.graph(self.graphs[li], capture_error_mode="thread_local"):
                self.tables[li] = st.res.resolve(li, rids, self.bufs[li])
        else:
            st.res._record_launches(True)
            try:
                self.tables[li] = st.res.resolve(li, rids, self.bufs[li])
            finally:
                st.res._record_launches(False)

    def write(self, sel: np.ndarray) -> None:
        """The step's selections, into the buffers the captured launches read."""
        for li in range(LAYERS):
            if self.st.cuda:
                self.bufs[li].copy_(torch.from_numpy(sel[li]))
            else:
                np.copyto(self.bufs[li], sel[li])

    def replay(self, layers) -> None:
        """`will_replay`, then the graphs (naming their rows: the batch bucket)."""
        layers = list(layers)
        self.st.res.will_replay(layers, self.rows)
        if self.st.cuda:
            for li in layers:
                self.graphs[li].replay()
        else:
            self.st.res._replay_recorded(layers, self.rows)

    def table(self, layer: int) -> np.ndarray:
        return _host(self.tables[layer])


def _padded(sel: np.ndarray, rows: int) -> np.ndarray:
    """`sel` ([layers, n, k]) under `rows` rows: the rows past n are padding, filled with
    entries a request could name (the resolver must not read them)."""
    out = np.zeros((sel.shape[0], rows, sel.shape[2]), dtype=np.int32)
    out[:, : sel.shape[1]] = sel
    out[:, sel.shape[1] :] = np.arange(sel.shape[2], dtype=np.int32)
    return out


def _replay_layers(eager: Stack, graphed: Stack, g: Graphs, rids: np.ndarray, sel) -> None:
    """One step's layers: each launched on the twin and replayed (padded to the graph's
    rows) on the graphed stack, both checked when the layer has run."""
    n = len(rids)
    g.write(_padded(sel, g.rows))
    for li in range(LAYERS):
        eager.check(rids, sel[li], li, eager.resolve(li, rids, sel[li]))
        g.replay([li])
        table = g.table(li)
        assert ((table[:n] >= 0) == (sel[li] >= 0)).all() and (table[n:] == -1).all()
        graphed.check(rids, sel[li], li, table[:n])


def _swap_in_a_long_request(*stacks: Stack) -> np.ndarray:
    """Request 5 ends and request 6, of 100 pages (wider than the others), takes its place."""
    for st in stacks:
        st.s.finish_request(5)
        st.admit(6, 800)
    return np.array([0, 1, 2, 3, 4, 6], dtype=np.int64)


def _admit_more(*stacks: Stack) -> np.ndarray:
    """Fourteen requests more (7 to 20) beside those `_swap_in_a_long_request` left."""
    for st in stacks:
        for rid in range(7, 21):
            st.admit(rid, 120 + 10 * rid)
    return np.array([0, 1, 2, 3, 4, 6, *range(7, 21)], dtype=np.int64)


def _run(eager: Stack, graphed: Stack, rids, sels, warm: int, state: dict) -> None:
    """Steps both stacks over `sels`: the first `warm` launch each layer on both; then the
    graphed stack captures (again when its epoch or its batch's size moved: the capture
    step replays all layers at once) and replays layer by layer, each layer checked when it
    has run."""
    k = sels[0].shape[2]
    for step, sel in enumerate(sels):
        _step(eager, rids, k)
        _step(graphed, rids, k)
        stale = state.get("epoch") != graphed.res.graph_epoch or state.get("rows") != len(rids)
        if step >= warm and stale:
            g = state["graphs"] = Graphs(graphed, rids, sel)
            state["epoch"], state["rows"] = graphed.res.graph_epoch, len(rids)
            state["captures"] += 1
            g.replay(range(LAYERS))
            for li in range(LAYERS):
                eager.check(rids, sel[li], li, eager.resolve(li, rids, sel[li]))
                assert ((g.table(li) >= 0) == (sel[li] >= 0)).all()
            # (The last layer's slots: no later launch of the step refilled them.)
            graphed.check(rids, sel[-1], LAYERS - 1, g.table(LAYERS - 1))
        elif step >= warm:
            _replay_layers(eager, graphed, state["graphs"], rids, sel)
            state["replays"] += 1
        else:
            for li in range(LAYERS):
                eager.check(rids, sel[li], li, eager.resolve(li, rids, sel[li]))
                graphed.check(rids, sel[li], li, graphed.resolve(li, rids, sel[li]))
        ra, rb = eager.s.end_step(), graphed.s.end_step()
        assert _record(ra) == _record(rb)
        if step >= warm:
            state["loaded"] = state.get("loaded", 0) + rb["loaded"]
        eager.s.validate()
        graphed.s.validate()


@pytest.mark.parametrize("device", DEVICES)
def test_replayed_launches_match_launching_each_layer_and_recapture_when_the_epoch_moves(device):
    lens = [150, 230, 310, 90, 170, 260]
    eager, graphed = (Stack(lens, device, more_pages=700, device_pages=320) for _ in range(2))
    k = 6
    rids = np.arange(len(lens), dtype=np.int64)
    state = {"captures": 0, "replays": 0}
    _run(eager, graphed, rids, list(_selections(eager, rids, k, 12)), 3, state)
    # (A capture again only where the epoch moved: the grant can outgrow its buffer.)
    assert state["captures"] + state["replays"] == 9 and state["replays"] >= 6
    assert state["loaded"] > 0  # the replayed launches copied misses in
    # A request ends and a longer one takes its place: the batch keeps its size, but the
    # page tables widen and move, so the epoch moves, and the old capture is refused (naming
    # the epoch) before anything changes; a replay of its stale arguments would name freed
    # memory.
    first_epoch = state["epoch"]
    rids = _swap_in_a_long_request(eager, graphed)
    _step(eager, rids, k)
    _step(graphed, rids, k)
    assert graphed.res.graph_epoch != first_epoch
    with pytest.raises(ConfigError, match="graph_epoch"):
        graphed.res.will_replay(range(LAYERS))
    if device == "cpu":
        with pytest.raises(CudaError, match="freed device memory"):
            graphed.res._replay_recorded([0])
    assert graphed.res.step_open
    for st in (eager, graphed):
        st.s.end_step()
        st.s.validate()
    captures = state["captures"]
    _run(eager, graphed, rids, list(_selections(eager, rids, k, 6, seed=9)), 0, state)
    assert state["captures"] > captures and state["captures"] + state["replays"] == 15
    # More requests: captured again for the wider batch.
    rids = _admit_more(eager, graphed)
    captures = state["captures"]
    _run(eager, graphed, rids, list(_selections(eager, rids, k, 6, seed=11)), 0, state)
    assert state["captures"] > captures and state["captures"] + state["replays"] == 21
    _ends_clean(rids, eager, graphed)


@on_cpu
def test_will_replay_refuses_what_a_capture_cannot_replay_before_anything_changes():
    lens = [120, 200, 160]
    st = Stack(lens, more_pages=20)
    k = 5
    rids = np.arange(3, dtype=np.int64)
    sel = next(_selections(st, rids, k, 1))
    with pytest.raises(ConfigError, match="step"):
        st.res.will_replay([0])
    _step(st, rids, k)
    with pytest.raises(ConfigError, match="layers"):
        st.res.will_replay([0])  # nothing captured
    with pytest.raises(ConfigError, match="rids"):
        st.res._record_launches(True)
        try:
            st.res.resolve(0, rids[::-1].copy(), sel[0])  # not the step's order
        finally:
            st.res._record_launches(False)
    g = Graphs(st, rids, sel)
    for bad, field in (
        ([1, 0], "layers"),  # not in capture order
        ([0, 0], "layers"),  # a layer twice
        ([LAYERS], "layers"),  # no such layer
        ([-1], "layers"),
        (5, "layers"),  # not an iterable
    ):
        with pytest.raises((ConfigError, OutOfRangeError)) as e:
            st.res.will_replay(bad)
        assert e.value.field == field
    g.replay([0, 1])
    with pytest.raises(ConfigError, match="layers"):
        st.res.will_replay([1])  # resolved already this step
    st.check(rids, sel[1], 1, g.table(1))
    # The rest launched one by one, after the replayed ones.
    for li in (2, 3):
        st.check(rids, sel[li], li, st.resolve(li, rids, sel[li]))
    st.s.end_step()
    st.s.validate()
    # A step of more requests than the captured rows replays none of them.
    st.admit(3, 90)
    _step(st, np.arange(4, dtype=np.int64), k)
    with pytest.raises(ConfigError, match="rids"):
        st.res.will_replay(range(LAYERS))
    st.s.end_step()
    # A grant narrower than the captured rows is refused.
    _step(st, rids, k - 2)
    with pytest.raises(ConfigError, match=r"selection\.shape"):
        st.res.will_replay(range(LAYERS))
    st.s.end_step()
    st.s.validate()


@on_cpu
def test_capture_needs_the_kernel():
    st = Stack([100, 140], kernel=False)
    rids = np.arange(2, dtype=np.int64)
    assert st.res.graph_epoch is None
    _step(st, rids, 4)
    with pytest.raises(ConfigError, match="resolver"):
        st.res.will_replay([0])
    with pytest.raises(ConfigError, match="resolver"):
        st.res._record_launches(True)
    st.s.end_step()


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=on_cpu), False])
def test_rows_past_the_steps_batch_are_padding_left_without_slots(kernel):
    st = Stack([120, 200, 160], kernel=kernel)
    twin = Stack([120, 200, 160], kernel=kernel)
    rids = np.arange(3, dtype=np.int64)
    sel = next(_selections(st, rids, 5, 1))
    _step(st, rids, 5)
    _step(twin, rids, 5)
    padded = _padded(sel, 8)
    for li in range(LAYERS):
        table = st.resolve(li, rids, padded[li])
        assert table.shape == (8, 5) and (table[3:] == -1).all()
        st.check(rids, sel[li], li, table[:3])
        twin.resolve(li, rids, sel[li])
    assert _record(st.s.end_step()) == _record(twin.s.end_step())
    # Padding needs the step's batch in its order; fewer rows than requests are refused.
    _step(st, rids, 5)
    with pytest.raises(ConfigError, match="rids"):
        st.resolve(0, rids[:2], padded[0])
    with pytest.raises(ConfigError, match=r"selection\.shape"):
        st.resolve(0, rids, sel[0][:2])
    for li in range(LAYERS):
        st.resolve(li, rids, sel[li])
    st.s.end_step()
    st.s.validate()


@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_captured_for_a_batch_bucket_replays_smaller_steps(device):
    # As engines capture graphs per batch size and pad: captured for 8 rows, replayed in
    # steps of 6, then 5 requests; the padding rows name pages, which the kernel must not read.
    lens = [150, 230, 310, 90, 170, 260]
    eager, graphed = (Stack(lens, device, device_pages=160) for _ in range(2))
    k, bucket = 6, 8
    rids = np.arange(6, dtype=np.int64)
    g, epoch, captures, replays = None, None, 0, 0
    for step, full in enumerate(_selections(eager, rids, k, 10)):
        if step == 4:
            for st in (eager, graphed):
                st.s.finish_request(5)
            rids = rids[:5]
        sel = full[:, : len(rids)]
        _step(eager, rids, k)
        _step(graphed, rids, k)
        padded = _padded(sel, bucket)
        if g is None or graphed.res.graph_epoch != epoch:
            g, epoch = Graphs(graphed, rids, padded), graphed.res.graph_epoch
            captures += 1
            g.replay(range(LAYERS))
            for li in range(LAYERS):
                eager.check(rids, sel[li], li, eager.resolve(li, rids, sel[li]))
            graphed.check(rids, sel[-1], LAYERS - 1, g.table(LAYERS - 1)[: len(rids)])
        else:
            _replay_layers(eager, graphed, g, rids, sel)
            replays += 1
        # The padding is neither selected nor loaded: the records count the requests' cells.
        assert _record(eager.s.end_step()) == _record(graphed.s.end_step())
        eager.s.validate()
        graphed.s.validate()
    assert replays >= 5 and captures <= 3
    _ends_clean(rids, eager, graphed)


@on_cpu
def test_captures_by_layer_and_bucket_and_their_calls_in_one_step():
    lens = [150, 230, 310, 90]
    st = Stack(lens, device_pages=160)
    k = 6
    rids = np.arange(4, dtype=np.int64)
    sels = list(_selections(st, rids, k, 4))
    # Piecewise: each layer captured, then replayed, before the next is captured.
    _step(st, rids, k)
    g = Graphs(st, rids, sels[0], layers=[])
    for li in range(LAYERS):
        g.capture(li, rids)
        with pytest.raises(ConfigError, match="layer"):
            g.capture(li, rids)  # captured already this step
        g.replay([li])
        st.check(rids, sels[0][li], li, g.table(li))
    st.s.end_step()
    # A second bucket's graph beside the first: a replay names its rows when both exist.
    _step(st, rids, k)
    wide = Graphs(st, rids, _padded(sels[1], 8))
    with pytest.raises(ConfigError, match="rows"):
        st.res.will_replay([0])
    wide.replay(range(LAYERS))
    st.check(rids, sels[1][-1], LAYERS - 1, wide.table(LAYERS - 1)[:4])
    st.s.end_step()
    _step(st, rids, k)
    g.write(sels[2])
    for li in range(LAYERS):
        try:
            g.replay([li])
        except ConfigError as e:
            assert e.field == "graph_epoch"  # (the grant outgrew its buffer: capture again)
            g.capture(li, rids)
            g.replay([li])
        st.check(rids, sels[2][li], li, g.table(li))
    st.s.end_step()
    st.s.validate()
    # A kernel put in place of another forgets every capture; its epochs go on.
    epoch = st.res.graph_epoch
    testing.use_host_kernel(st.res, 1)
    _step(st, rids, k)
    assert st.res.graph_epoch > epoch
    with pytest.raises(ConfigError, match="layers"):
        st.res.will_replay([0], 4)
    for li in range(LAYERS):
        st.check(rids, sels[3][li], li, st.resolve(li, rids, sels[3][li]))
    st.s.end_step()
    st.s.validate()


@pytest.mark.parametrize("device", DEVICES)
def test_reserved_buffers_keep_one_capture_for_the_whole_run(device):
    # As an engine captures its graphs once at start-up: the resolver sized for its largest
    # batch bucket, longest request and widest rows, one capture of the bucket serves every
    # step: batches that shrink, grow, and change their requests, a request that outgrows
    # the others, bursts of misses.
    lens = [150, 230, 310, 90, 170, 260]
    eager, graphed = (Stack(lens, device, more_pages=700, device_pages=320) for _ in range(2))
    k, bucket = 6, 24
    rids = np.arange(6, dtype=np.int64)
    _step(graphed, rids, k)
    with pytest.raises(ConfigError, match="step"):
        graphed.res.reserve(bucket, k, 128)  # not while a step is open
    graphed.s.end_step()
    _step(eager, rids, k)
    eager.s.end_step()
    graphed.res.reserve(bucket, k, 128)
    g, epoch, steps = None, None, 0
    for phase in range(3):
        if phase == 1:
            rids = _swap_in_a_long_request(eager, graphed)
        if phase == 2:
            rids = _admit_more(eager, graphed)
        for sel in _selections(eager, rids, k, 5, seed=20 + phase):
            _step(eager, rids, k)
            _step(graphed, rids, k)
            padded = _padded(sel, bucket)
            if g is None:
                g, epoch = Graphs(graphed, rids, padded), graphed.res.graph_epoch
                g.replay(range(LAYERS))
                for li in range(LAYERS):
                    eager.check(rids, sel[li], li, eager.resolve(li, rids, sel[li]))
            else:
                assert graphed.res.graph_epoch == epoch  # nothing moved: no capture again
                _replay_layers(eager, graphed, g, rids, sel)
            assert _record(eager.s.end_step()) == _record(graphed.s.end_step())
            graphed.s.validate()
            steps += 1
    assert steps == 15
    _ends_clean(rids, eager, graphed)


@on_cpu
def test_two_buckets_captured_in_one_step_replay_in_later_steps():
    # Bucket A's layer 0, bucket B's layer 0, A replayed, then B's layer 1: each bucket's
    # launches are numbered from where its own replay will start.
    st = Stack([150, 230, 310, 90], device_pages=160)
    k = 6
    rids = np.arange(4, dtype=np.int64)
    sels = list(_selections(st, rids, k, 3))
    st.res.reserve(8, k, 64)  # (so that no later step moves the buffers)
    _step(st, rids, k)
    a = Graphs(st, rids, sels[0], layers=[])
    b = Graphs(st, rids, _padded(sels[0], 8), layers=[])
    a.capture(0, rids)
    b.capture(0, rids)
    a.replay([0])
    b.capture(1, rids)
    st.check(rids, sels[0][0], 0, a.table(0))
    for li in range(1, LAYERS):
        st.check(rids, sels[0][li], li, st.resolve(li, rids, sels[0][li]))
    st.s.end_step()
    for sel in sels[1:]:
        _step(st, rids, k)
        b.write(_padded(sel, 8))
        for li in (0, 1):
            b.replay([li])
            st.check(rids, sel[li], li, b.table(li)[:4])
        for li in range(2, LAYERS):
            st.check(rids, sel[li], li, st.resolve(li, rids, sel[li]))
        st.s.end_step()
        st.s.validate()
