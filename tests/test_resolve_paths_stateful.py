"""The two resolve paths side by side, as a hypothesis state machine: one runtime resolves its
decode steps on the device (`resolve="device"`), the other plans them on the host, with the
same device, host and Indexer-K budgets, and both take the same rules (requests added over a
shared system prompt, steps, aborts, finishes, unlocked prefix pages evicted) in lockstep.

After every rule the two must agree on what does not depend on which objects a full device
gives up (the two paths choose their victims differently: the host path by its LRU at each
layer, the device path from a grant taken at the step's start):
- every request's outputs, bit for bit;
- each step's record: the entries selected, the distinct objects read (a prefix object two
  rows read counts once), the bytes needed;
- the directory's host side (objects, host pages ready and being written), and the prefix
  cache's matches at admission.

On a device with room for every page (`ample`), nothing is evicted and the two must agree on
everything: each step's loads, bytes moved and bytes needed among them (read amplification),
and which objects are on the device. Each runtime's own `validate()` (for the device path,
its mirror against the directory) runs after every rule, and at the end nothing is pinned,
held or in flight in either. The `Kernel` machines put the CUDA kernel's own source (compiled
for the CPU, its cells racing on threads) in the reference's place on the device side."""

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparsetier import testing
from sparsetier.tools.model import ModelConfig, TinySparseModel
from sparsetier.tools.runtime import DecodeRuntime

MODEL = TinySparseModel(ModelConfig(layers=3, seed=7))
_g = torch.Generator().manual_seed(13)
SYSTEM = torch.randint(0, 512, (41,), generator=_g)
PROMPTS = [torch.cat([SYSTEM, torch.randint(0, 512, (n,), generator=_g)]) for n in (19, 52, 80)]
CONCURRENT = 3
# Record fields both paths count alike on any device, and those alike only with no eviction.
# (A prefix object two rows read is one object in both: `pages` counts distinct objects.)
ALWAYS = ("requests", "selected", "pages", "bytes_needed")
NO_EVICTION = (
    "ready",
    "loaded",
    "bytes_transferred",
    "bytes_needed_of_transferred",
    "read_amplification",
)
HOST_SIDE = ("objects", "host_none", "host_writing", "host_ready")


class ResolvePathsMachine(RuleBasedStateMachine):
    MODE = "block"
    KERNEL = False  # the device side runs the CUDA kernel's source on CPU threads

    def _runtime(self, resolve: str) -> DecodeRuntime:
        return DecodeRuntime(
            MODEL, page_size=8, device_slots=self.slots, host_pages=160, indexer_pages=80,
            topk=3 if self.MODE == "block" else 10, selection=self.MODE, prefetch=False,
            resolve=resolve,
        )  # fmt: skip

    @initialize(ample=st.booleans(), threads=st.sampled_from([1, 4, 8]))
    def runtimes(self, ample, threads):
        # Tight: two long requests hold most of the device, so steps evict and load.
        self.ample = ample
        self.slots = 2000 if ample else 72
        event("ample device" if ample else "tight device")
        self.dev, self.host = self._runtime("device"), self._runtime("host")
        if self.KERNEL:
            # 1 thread: the kernel's order on one warp; 4 and 8: cells racing.
            testing.use_host_kernel(self.dev, threads)
        self.both = (self.dev, self.host)
        self.steps_of: dict[int, int] = {}
        self.next_rid = 0

    def _running(self) -> list[int]:
        return sorted(self.dev.requests)

    @precondition(lambda self: len(self.dev.requests) < CONCURRENT)
    @rule(prompt=st.sampled_from(range(len(PROMPTS))), steps=st.integers(2, 7))
    def add(self, prompt, steps):
        rid = self.next_rid
        self.next_rid += 1
        self.steps_of[rid] = steps
        a, b = (rt.add_request(rid, PROMPTS[prompt], steps) for rt in self.both)
        assert a["matched_pages"] == b["matched_pages"], (a, b)
        if a["matched_pages"]:
            event("a prefix hit")

    @precondition(lambda self: any(not r.done for r in self.dev.requests.values()))
    @rule()
    def step(self):
        a, b = (rt.step() for rt in self.both)
        assert a.failed == b.failed == []
        for f in ALWAYS + (NO_EVICTION if self.ample else ()):
            assert getattr(a, f) == getattr(b, f), (f, a.core, b.core)
        if a.loaded:
            event(f"a step loaded pages ({'ample' if self.ample else 'tight'} device)")
        if a.loaded != b.loaded:
            event("the paths loaded differently (their victims differ)")

    # Unlocked prefix pages leave the device only (the next hit on them loads from host, on an
    # ample device too), or both tiers.
    @rule(host=st.booleans())
    def evict_prefixes(self, host):
        for rt in self.both:
            rt.scheduler.evict_prefix(10**6, 10**6 if host else 0)

    @precondition(lambda self: self.dev.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self._running()))
        for rt in self.both:
            rt.abort(rid)

    @precondition(lambda self: any(r.done for r in self.dev.requests.values()))
    @rule()
    def finish_done(self):
        for rid in [r.rid for r in self.dev.requests.values() if r.done]:
            a, b = (rt.finish_request(rid) for rt in self.both)
            assert len(a.outputs) == len(b.outputs) == self.steps_of[rid]

    @invariant()
    def agree(self):
        # One invariant, so that the checks run in this order, after the copies settle.
        for rt in self.both:
            rt.drain()
            rt.scheduler.validate()
        self._same_outputs()
        self._same_directory()

    def _same_outputs(self):
        assert self.dev.requests.keys() == self.host.requests.keys()
        for rid, r in self.dev.requests.items():
            q = self.host.requests[rid]
            assert len(r.outputs) == len(q.outputs)
            assert all(torch.equal(x, y) for x, y in zip(r.outputs, q.outputs, strict=True)), rid

    def _same_directory(self):
        a, b = (rt.scheduler.residency.stats() for rt in self.both)
        for f in HOST_SIDE:
            assert a[f] == b[f], (f, a, b)
        if self.ample:
            # The device path's objects on the device: the directory's, and those only its
            # resolver's pool holds.
            pooled = self.dev.scheduler.device_stats()["pool_live"]
            assert a["device_ready"] + pooled == b["device_ready"], (pooled, a, b)

    def teardown(self):
        for rt in getattr(self, "both", ()):
            for rid in list(rt.requests):
                rt.abort(rid)
            rt.drain()
            rt.scheduler.validate()
            s = rt.scheduler.stats()
            assert (s["pins"], s["handles"], s["transfers_in_flight"]) == (0, 0, 0), s


class TokenResolvePathsMachine(ResolvePathsMachine):
    MODE = "token"


class KernelResolvePathsMachine(ResolvePathsMachine):
    # Cells race for claims, victims and the grant: slots differ from the reference's, what
    # each cell reads and (with room) every count must not.
    KERNEL = True


class KernelTokenResolvePathsMachine(KernelResolvePathsMachine):
    MODE = "token"


# Each rule runs the tiny model in two runtimes: a tenth of the profile's examples.
_fewer = settings(
    max_examples=max(5, settings.default.max_examples // 10),
    stateful_step_count=min(30, settings.default.stateful_step_count),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestResolvePathsMachine = ResolvePathsMachine.TestCase
TestResolvePathsMachine.settings = _fewer
TestTokenResolvePathsMachine = TokenResolvePathsMachine.TestCase
TestTokenResolvePathsMachine.settings = _fewer
TestKernelResolvePathsMachine = KernelResolvePathsMachine.TestCase
TestKernelResolvePathsMachine.settings = _fewer
TestKernelTokenResolvePathsMachine = KernelTokenResolvePathsMachine.TestCase
TestKernelTokenResolvePathsMachine.settings = _fewer
