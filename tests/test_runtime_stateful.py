"""The decode runtime's request lifecycle as a hypothesis state machine: requests are added,
decoded, aborted, finished, fail (injected load faults, a layer's load and retry both failing)
and are restarted (`DecodeRuntime.restart`), in any order.

The reference model is each request's state (running, or ended: failed or aborted) and its
output count: a step gives every running request that is not done one output, except those it
reports failed, which end with the count they had; an abort keeps the count, and a restart
keeps it too (the outputs so far are the request's; the failed step's output is computed
again later). After every rule the scheduler's own `validate()` runs and the runtime's
requests and `ended` match the model; at the end, with every request finished or aborted and
the engine drained, nothing is pinned, held or in flight.

The data is checked too, against a resident twin: a second runtime with room for every page
(nothing evicted, nothing loaded, no faults) is driven in lockstep through the same rules, and
ends each request the tiered one failed at the same point, dropping the failed step's output,
as `sparsetier demo`'s resident run does. After every rule every request's outputs (running or
ended, restarted ones included) are bit-identical in the two, and both matched the same prefix
pages at admission. A case either runs with prefetch (and no faults: which load a fault hits
would then depend on copy timing, and hypothesis could not replay it) or with faults. Three
machines: block selections, token selections mapped to pages in the core, and token
selections mapped on the model's device and planned as counted page rows; and two more that
drive the tiered runtime's decode steps through the device resolver (`resolve="device"`,
block and token selections) against the same host-planned resident twin, so the two resolve
paths run the same stream and must give the same outputs, with the scheduler's checks (the
device mirror against the directory among them) after every rule; and two more with the CUDA
kernel's own source (compiled for the CPU, its cells racing on threads) as the resolver.

Four more machines (host and device paths, block and token selections) do not settle after
each rule: copies are held back (`slow_loads`) and only the `drain` rule waits for them, so
steps are granted and planned over loads still in flight (a prefix hit's restore among them),
and aborts, restarts and evictions land under them. They inject no faults, so the outcome of
a case does not depend on copy timing and hypothesis can replay it. Every machine draws a
tight device budget in a quarter of its cases (the device resolver then cannot be granted
some steps, which plan on the host) and wide selections (a layer reading most of a request's
pages) in half.
"""

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import sparsetier as sp
from sparsetier import testing
from sparsetier.tools.model import ModelConfig, TinySparseModel
from sparsetier.tools.runtime import DecodeRuntime

MODEL = TinySparseModel(ModelConfig(seed=3))
_g = torch.Generator().manual_seed(11)
SYSTEM = torch.randint(0, 512, (37,), generator=_g)
PROMPTS = [torch.cat([SYSTEM, torch.randint(0, 512, (n,), generator=_g)]) for n in (23, 48, 73)]
CONCURRENT = 3


class RuntimeMachine(RuleBasedStateMachine):
    MODE = "block"
    TOKEN_MAP = "core"
    RESOLVE = "host"  # the tiered runtime's; the twin always plans on the host
    KERNEL = False  # resolve="device": the CUDA kernel's source run on CPU threads
    # Every transfer settled after each rule; else only by the `drain` rule, and no faults
    # (which load a fault hits would depend on which are still in flight, so on copy timing,
    # and hypothesis could not replay a case).
    SETTLE = True

    def __init__(self):
        super().__init__()
        self.outputs: dict[int, int] = {}  # running rid -> outputs it has
        self.steps_of: dict[int, int] = {}  # rid -> its decode steps
        self.ended: dict[int, int] = {}  # failed or aborted rid -> outputs it had
        self.failed: set[int] = set()  # ended rids that failed (the others were aborted)
        self.matched: dict[int, int] = {}  # rid -> prefix pages its latest admission matched
        self.next_rid = 0

    def _runtime(
        self, device_slots: int, prefetch: bool, resolve: str = "host", restore: str = "indexer"
    ) -> DecodeRuntime:
        return DecodeRuntime(
            MODEL, page_size=8, device_slots=device_slots, host_pages=200, indexer_pages=80,
            topk=self.topk, selection=self.MODE, prefetch=prefetch,
            token_map=self.TOKEN_MAP, resolve=resolve, restore=restore,
        )  # fmt: skip

    # A quarter of the cases prefetch; the rest inject faults. The tiered runtime's prefix
    # hits restore as its restore policy decides (the twin's Indexer-K only): what a hit
    # restores changes what moves, never an output.
    @initialize(
        prefetch=st.sampled_from([False, False, False, True]),
        restore=st.sampled_from(["auto", "indexer", "full", "predicted"]),
        threads=st.sampled_from([1, 4, 8]),
        tight=st.sampled_from([False, False, False, True]),
        wide=st.booleans(),
    )
    def two_long_requests(self, prefetch, restore, threads, tight, wide):
        # A device budget small enough that decode steps load from host (so load faults hit);
        # a tight one (near the fewest slots three requests of the longest prompt need) leaves the
        # device resolver without a grant at some steps, which plan on the host. The twin has
        # room for every page and the same host and Indexer-K budgets, so its prefix cache
        # keeps what the tiered one keeps.
        self.prefetch, self.tight = prefetch, tight
        if prefetch:
            event("prefetch on (no faults)")
        event(f"restore {restore}")
        # Wide selections: a layer reads most of a request's pages (10 blocks, 30 tokens).
        self.topk = (10 if wide else 3) if self.MODE == "block" else (30 if wide else 10)
        slots = (52 if wide else 44) if tight else 60
        self.rt = self._runtime(slots, prefetch, self.RESOLVE, restore)
        if self.KERNEL:
            # 1 thread: the kernel's order on one warp; 4 and 8: cells racing.
            testing.use_host_kernel(self.rt, threads)
        self.twin = self._runtime(2000, False)
        # Two requests over the longest prompt hold most of the device, so what comes next
        # evicts and loads (and load faults find loads to fail).
        for _ in range(2):
            self.add(len(PROMPTS) - 1, 8)

    def _running_undone(self) -> list[int]:
        return [r for r, n in self.outputs.items() if n < self.steps_of[r]]

    @precondition(lambda self: len(self.outputs) < CONCURRENT)
    @rule(prompt=st.sampled_from(range(len(PROMPTS))), steps=st.integers(2, 8))
    def add(self, prompt, steps):
        rid = self.next_rid
        self.next_rid += 1
        self.steps_of[rid] = steps
        twin = self.twin.add_request(rid, PROMPTS[prompt], steps)
        self.matched[rid] = twin["matched_pages"]
        try:
            adm = self.rt.add_request(rid, PROMPTS[prompt], steps)
        except sp.RequestFailedError:
            self.twin.abort(rid)  # ended where the tiered one's prefill failed
            self.ended[rid] = 0
            self.failed.add(rid)
            return
        assert adm["matched_pages"] == self.matched[rid], (adm, twin)
        if adm["full_restore_objects"]:
            event("a prefix hit restored whole")
        self.outputs[rid] = 0

    @precondition(lambda self: self.outputs)
    @rule()
    def step(self):
        undone = self._running_undone()
        fallbacks = self._fallbacks()
        rec = self.rt.step()
        twin = self.twin.step()
        if self._fallbacks() > fallbacks:
            event("a device-resolved step planned on the host")
        assert not twin.failed, twin.failed
        assert set(rec.failed) <= set(undone), (rec.failed, undone)
        if rec.failed:
            event("a step failed requests")
        if rec.loaded:
            event("a step loaded pages")
        for rid in undone:
            if rid in rec.failed:
                self.ended[rid] = self.outputs.pop(rid)
                self.failed.add(rid)
                # As the failure did: the step's output is not the request's.
                self.twin.abort(rid)
                del self.twin.ended[rid].outputs[-1]
            else:
                self.outputs[rid] += 1

    @rule(host=st.booleans())
    def evict_prefixes(self, host):
        # Every prefix page no running request holds leaves the device (its next hit restores
        # from host), or both tiers, in both runtimes (so they still match alike): the host
        # pages a running request reads, the device resolver's copies among them, must stay.
        for rt in (self.rt, self.twin):
            rt.scheduler.evict_prefix(10**6, 10**6 if host else 0)

    @rule()
    def evict_device_kv(self):
        # Every main-KV object the tiered runtime does not pin leaves its device (written
        # through first): later plans, and a prefix hit's full restore, load them again.
        if testing.evict_device(self.rt.scheduler, 10**6):
            event("device KV evicted")

    @precondition(lambda self: self.outputs)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.outputs)))
        self.rt.abort(rid)
        self.twin.abort(rid)
        self.ended[rid] = self.outputs.pop(rid)
        self.failed.discard(rid)

    @precondition(lambda self: self.ended and len(self.outputs) < CONCURRENT)
    @rule(data=st.data())
    def restart(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ended)))
        twin = self.twin.restart(rid)
        self.matched[rid] = twin["matched_pages"]
        try:
            adm = self.rt.restart(rid)
        except sp.RequestFailedError:
            event("a restart's prefill failed")
            self.twin.abort(rid)
            return  # its prefill failed too: still ended, as it was
        assert adm["matched_pages"] == self.matched[rid], (adm, twin)
        event("restarted after a failure" if rid in self.failed else "restarted after an abort")
        self.outputs[rid] = self.ended.pop(rid)
        self.failed.discard(rid)

    @rule(rid=st.integers(0, 40))
    def restart_what_is_not_ended(self, rid):
        if rid in self.ended:
            return
        try:
            self.rt.restart(rid)
        except sp.ConfigError as e:
            assert e.field == "rid"
        else:
            raise AssertionError(f"restarted {rid}, which had not ended")

    @precondition(lambda self: any(n >= self.steps_of[r] for r, n in self.outputs.items()))
    @rule()
    def finish_done(self):
        for rid in [r for r, n in self.outputs.items() if n >= self.steps_of[r]]:
            r = self.rt.finish_request(rid)
            assert len(r.outputs) == self.steps_of[rid]
            self._same_outputs(rid, r, self.twin.finish_request(rid))
            del self.outputs[rid]

    def _fallbacks(self) -> int:
        return self.rt.scheduler.device_stats()["fallbacks"] if self.RESOLVE == "device" else 0

    def _armed(self, kind: str) -> int:
        return self.rt.scheduler.stats()[f"faults_armed_{kind}"]

    # One fault armed at a time: a load and its retry (count 2) fail a request; a failed
    # backup is retried at the next step (failing without end, pages that cannot be written
    # through cannot be evicted, and the device would fill: a capacity error, not a bug).
    @precondition(lambda self: self.SETTLE and not self.prefetch and self._armed("loads") == 0)
    # A copy worker's panic (a bug in the copy path) is a failure like any other.
    @rule(
        count=st.integers(1, 2),
        layer=st.none() | st.integers(0, MODEL.c.layers - 1),
        panic=st.booleans(),
    )
    def load_faults(self, count, layer, panic):
        self.rt.inject_faults("load", count, layer, panic=panic)

    # (Not on a tight device: pages not written through cannot be evicted, and a third
    # request's prefill would find too few slots.)
    @precondition(
        lambda self: (
            self.SETTLE and not self.prefetch and not self.tight and self._armed("backups") == 0
        )
    )
    @rule(panic=st.booleans())
    def backup_fault(self, panic):
        self.rt.inject_faults("backup", 1, panic=panic)

    # Without settling, the next rule finds copies in flight: a full restore's loads at the
    # next step's grant, a step's loads under an abort or an eviction. Slow copies (the cpu
    # engine holds them back) make that the rule, not a race the copies usually win.
    @precondition(lambda self: not self.SETTLE)
    @rule(count=st.integers(1, 12))
    def slow_loads(self, count):
        self.rt.inject_faults("load", count, delay=0.02)

    @precondition(lambda self: not self.SETTLE)
    @rule()
    def drain(self):
        self.rt.drain()

    @invariant()
    def settle(self):
        # (The device path's resolver keeps its pool across a drain: the next steps run on
        # what earlier ones left on the device.)
        if self.SETTLE:
            self.rt.drain()
        if self.rt.scheduler.stats()["transfers_in_flight"]:
            event("transfers in flight after a rule")

    @invariant()
    def matches_the_model(self):
        self.rt.scheduler.validate()
        assert {r: len(q.outputs) for r, q in self.rt.requests.items()} == self.outputs
        assert {r: len(q.outputs) for r, q in self.rt.ended.items()} == self.ended

    @staticmethod
    def _same_outputs(rid, tiered, twin):
        assert len(tiered.outputs) == len(twin.outputs), rid
        for n, (a, b) in enumerate(zip(tiered.outputs, twin.outputs, strict=True)):
            assert torch.equal(a, b), f"request {rid}: output {n} differs from the resident run's"

    @invariant()
    def matches_the_resident_twin(self):
        assert self.twin.requests.keys() == self.rt.requests.keys()
        for rid, r in self.rt.requests.items():
            self._same_outputs(rid, r, self.twin.requests[rid])
        for rid in self.ended:
            self._same_outputs(rid, self.rt.ended[rid], self.twin.ended[rid])

    def teardown(self):
        for rid in list(self.rt.requests):
            self.rt.abort(rid)
        self.rt.drain()
        self.rt.scheduler.validate()
        s = self.rt.scheduler.stats()
        assert (s["pins"], s["handles"], s["transfers_in_flight"]) == (0, 0, 0), s


class TokenRuntimeMachine(RuntimeMachine):
    MODE = "token"


class MappedTokenRuntimeMachine(RuntimeMachine):
    # Token rows mapped to pages with counts on the model's device (`token_map="device"`),
    # planned as counted page rows (`plan_counted`), in both runtimes.
    MODE = "token"
    TOKEN_MAP = "device"


class DeviceRuntimeMachine(RuntimeMachine):
    # Decode steps resolved by the device resolver, against the host-planned twin.
    RESOLVE = "device"


class DeviceTokenRuntimeMachine(RuntimeMachine):
    MODE = "token"
    RESOLVE = "device"


class KernelRuntimeMachine(RuntimeMachine):
    # The same, with the CUDA kernel's source (compiled for the CPU, its cells racing on 4
    # threads) in place of the reference: it takes no copy faults, so the load faults armed
    # fail the host-planned steps' loads (prefill) and wait for those.
    RESOLVE = "device"
    KERNEL = True


class KernelTokenRuntimeMachine(KernelRuntimeMachine):
    MODE = "token"


class InFlightRuntimeMachine(RuntimeMachine):
    # Transfers settle only when the `drain` rule says so.
    SETTLE = False


class InFlightTokenRuntimeMachine(InFlightRuntimeMachine):
    MODE = "token"


class InFlightDeviceRuntimeMachine(InFlightRuntimeMachine):
    RESOLVE = "device"


class InFlightDeviceTokenRuntimeMachine(InFlightRuntimeMachine):
    MODE = "token"
    RESOLVE = "device"


# Each rule runs the tiny model (a step or a prefill) in two runtimes, so these machines take
# a tenth of the profile's examples (SPARSETIER_HYPOTHESIS=deep: 200 of up to 30 rules).
_fewer = settings(
    max_examples=max(5, settings.default.max_examples // 10),
    stateful_step_count=min(30, settings.default.stateful_step_count),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _case(machine: type[RuntimeMachine]):
    case = machine.TestCase
    case.settings = _fewer
    return case


TestRuntimeMachine = _case(RuntimeMachine)
TestTokenRuntimeMachine = _case(TokenRuntimeMachine)
TestMappedTokenRuntimeMachine = _case(MappedTokenRuntimeMachine)
TestDeviceRuntimeMachine = _case(DeviceRuntimeMachine)
TestDeviceTokenRuntimeMachine = _case(DeviceTokenRuntimeMachine)
TestKernelRuntimeMachine = _case(KernelRuntimeMachine)
TestKernelTokenRuntimeMachine = _case(KernelTokenRuntimeMachine)
TestInFlightRuntimeMachine = _case(InFlightRuntimeMachine)
TestInFlightTokenRuntimeMachine = _case(InFlightTokenRuntimeMachine)
TestInFlightDeviceRuntimeMachine = _case(InFlightDeviceRuntimeMachine)
TestInFlightDeviceTokenRuntimeMachine = _case(InFlightDeviceTokenRuntimeMachine)
