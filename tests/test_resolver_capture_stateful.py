"""The device resolver's captures and replays as a hypothesis state machine, against a model of
what `will_replay` must accept: steps open and end; layers are captured for a batch bucket (the
step's requests, or more rows of padding), replayed, or launched eagerly, in any order. The
model keeps each capture's epoch, rows, width and call, the launches captured and not replayed
in the open step, and the step's calls; after every rule the resolver must have accepted
exactly what the model accepts, with the model's error field when it refused. Every layer
that ran (replayed or eager) is checked at once: each selected cell's slot holds its page's
rows as the model wrote them. Each step ends with `validate()`, and nothing stays pinned.
On the CPU, the kernel's own source records a launch's arguments and replays them as they are
(`test_resolver_capture.py`)."""

import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_resolver_capture import (
    HOST_KERNEL,
    LAYERS,
    Graphs,
    Stack,
    _ends_clean,
    _padded,
    _selections,
    _step,
)

from sparsetier.errors import ConfigError, OutOfRangeError

pytestmark = pytest.mark.skipif(
    not HOST_KERNEL, reason="needs a build with the testing and host-kernel features (make build)"
)
LENS = [150, 230, 90]


class CaptureMachine(RuleBasedStateMachine):
    @initialize(k=st.sampled_from([3, 6]), reserve=st.booleans(), seed=st.integers(0, 99))
    def setup(self, k, reserve, seed):
        self.st = Stack(LENS, device_pages=160, seed=seed)
        self.k, self.rids = k, np.arange(len(LENS), dtype=np.int64)
        self.sels = _selections(self.st, self.rids, k, 10_000, seed=seed)
        if reserve:
            self.st.res.reserve(8, k, 64)
        self.open = False
        # Model: (layer, rows) -> (epoch, k, call); the open step's pending captures (in
        # order), calls, resolved layers; the graphs holding each capture's buffers.
        self.captured: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.pending: list[tuple[int, int]] = []
        self.calls, self.resolved = 0, set()
        self.graphs: dict[int, Graphs] = {}

    @precondition(lambda self: not self.open)
    @rule(narrow=st.booleans())
    def begin(self, narrow):
        # A narrow grant: rows of one entry fewer than the captures' (and the selections').
        self.entries = self.k - 1 if narrow else self.k
        _step(self.st, self.rids, self.entries)
        self.open, self.calls, self.resolved, self.pending = True, 0, set(), []
        self.sel = next(self.sels)
        self.epoch = self.st.res.graph_epoch

    @precondition(lambda self: self.open)
    @rule()
    def end(self):
        self.st.s.end_step()
        self.st.s.validate()
        self.open = False

    def _rows(self, bucket: int) -> int:
        return len(self.rids) + bucket

    @precondition(lambda self: self.open)
    @rule(layer=st.integers(0, LAYERS - 1), bucket=st.sampled_from([0, 2]))
    def capture(self, layer, bucket):
        rows = self._rows(bucket)
        if layer in self.resolved:
            why = "layer"
        elif self.k > self.entries:
            why = "selection.shape"
        elif (layer, rows) in self.pending:
            why = "layer"
        else:
            why = None
        g = self.graphs.get(rows)
        if g is None:
            g = self.graphs[rows] = Graphs(self.st, self.rids, _padded(self.sel, rows), [])
        g.write(_padded(self.sel, rows))
        if why is not None:
            with pytest.raises(ConfigError) as e:
                g.capture(layer, self.rids)
            assert e.value.field == why
            return
        last = [self.captured[p][2] for p in self.pending if p[1] == rows]
        call = (last[-1] if last else self.calls) + 1
        g.capture(layer, self.rids)
        self.captured[(layer, rows)] = (self.epoch, self.k, call)
        self.pending.append((layer, rows))

    def _refusal(self, layers: list[int], rows: int) -> str | None:
        """The field `will_replay(layers, rows)` must name, or None when it must accept."""
        call, seen = self.calls, set()
        for layer in layers:
            c = self.captured.get((layer, rows))
            if c is None:
                return "layers"
            if layer in self.resolved or layer in seen:
                return "layers"
            seen.add(layer)
            epoch, k, ccall = c
            if k > self.entries:
                return "selection.shape"
            if epoch != self.epoch:
                return "graph_epoch"
            if ccall != call + 1:
                return "layers"
            call += 1
        return None

    @precondition(lambda self: self.open)
    @rule(
        layers=st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=3),
        bucket=st.sampled_from([0, 2]),
    )
    def replay(self, layers, bucket):
        rows = self._rows(bucket)
        why = self._refusal(layers, rows)
        event(f"replay: {why or 'accepted'}")
        g = self.graphs.get(rows)
        if why is not None or g is None:
            with pytest.raises((ConfigError, OutOfRangeError)) as e:
                self.st.res.will_replay(layers, rows)
            assert e.value.field == (why or "layers")
            return
        g.write(_padded(self.sel, rows))
        g.replay(layers)
        last = layers[-1]
        # (The last layer's slots: no later launch of the step refilled them yet.)
        self.st.check(self.rids, self.sel[last], last, g.table(last)[: len(self.rids)])
        assert (g.table(last)[len(self.rids) :] == -1).all()
        for layer in layers:
            self.resolved.add(layer)
            if (layer, rows) in self.pending:
                self.pending.remove((layer, rows))
        self.calls += len(layers)

    @precondition(lambda self: self.open)
    @rule(bucket=st.sampled_from([0, 2]), n=st.integers(1, LAYERS))
    def replay_in_order(self, bucket, n):
        """Replays the next `n` launches captured for the bucket, in their calls' order."""
        rows = self._rows(bucket)
        by_call = {c[2]: key[0] for key, c in self.captured.items() if key[1] == rows}
        layers = []
        while len(layers) < n and self.calls + len(layers) + 1 in by_call:
            layers.append(by_call[self.calls + len(layers) + 1])
        if layers:
            self.replay(layers, bucket)

    @precondition(lambda self: self.open)
    @rule(layer=st.integers(0, LAYERS - 1))
    def eager(self, layer):
        why = "layer" if layer in self.resolved else None
        why = why or ("selection.shape" if self.k > self.entries else None)
        if why is not None:
            with pytest.raises(ConfigError) as e:
                self.st.resolve(layer, self.rids, self.sel[layer])
            assert e.value.field == why
            return
        table = self.st.resolve(layer, self.rids, self.sel[layer])
        self.st.check(self.rids, self.sel[layer], layer, table)
        self.resolved.add(layer)
        self.calls += 1

    @invariant()
    def open_as_modelled(self):
        if hasattr(self, "st"):
            assert self.st.res.step_open == self.open

    def teardown(self):
        if not hasattr(self, "st"):
            return
        if self.open:
            self.st.s.end_step()
        _ends_clean(self.rids, self.st)


TestCaptureMachine = CaptureMachine.TestCase
