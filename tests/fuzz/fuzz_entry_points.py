"""Fuzz target (atheris) for the planning code and the builder's checks: pool specs, stack
plans, transfer plans and directory operations fed with arbitrary values. Any failure must be
a typed `sparsetier.SparsetierError`; anything else (another exception, a crash) is a finding,
and so is an `InvariantError` (a broken invariant, or its subclass `InternalError`: a panic the
core caught at the boundary), though it is typed.

    python tests/fuzz/fuzz_entry_points.py -runs=20000     # bounded pass (CI runs one)
    python tests/fuzz/fuzz_entry_points.py -max_total_time=600
"""

import sys

import atheris
import numpy as np

with atheris.instrument_imports():
    import sparsetier as st
    from sparsetier import lowlevel, testing

COMPONENTS = ["KV", "INDEXER", "SWA", "DRAFT", "kv", "", "VALUE", "\x00"]
DTYPES = ["bf16", "fp16", "fp32", "fp8_e4m3", "torch.bfloat16", "int8", ""]
LAYOUTS = ["layer_first", "layer_page_first", "page_first", ""]
BACKENDS = ["cpu", "kernel", "direct", "gds", ""]


def an_int(f: atheris.FuzzedDataProvider) -> int:
    kind = f.ConsumeIntInRange(0, 3)
    if kind == 0:
        return f.ConsumeIntInRange(-3, 70)
    if kind == 1:
        return f.ConsumeIntInRange(0, 1 << 20)
    return f.ConsumeIntInRange(-(1 << 62), 1 << 62)


def spec(f: atheris.FuzzedDataProvider):
    return st.PoolSpec(
        f.PickValueInList(COMPONENTS),
        an_int(f),
        an_int(f),
        an_int(f),
        f.PickValueInList(DTYPES),
        an_int(f),
        an_int(f),
        None if f.ConsumeBool() else an_int(f),
    )


def scheduler_ops(f: atheris.FuzzedDataProvider) -> None:
    """The step scheduler's entry points with arbitrary requests, selections and units."""
    import torch

    spec = st.PoolSpec("KV", 1, 1, 2, "bf16", 4, 24)
    dev = torch.zeros(spec.shape(), dtype=torch.bfloat16)
    host = torch.zeros(spec.with_pages(64).shape(), dtype=torch.bfloat16)
    s = st.StepScheduler(
        st.PageTransferBinding(dev, spec),
        st.PageTransferBinding(host, spec.with_pages(64)),
        st.TransferEngine("cpu", threads=1),
        layers=f.ConsumeIntInRange(1, 3),
        prefetch=f.ConsumeBool(),
    )
    for _ in range(f.ConsumeIntInRange(1, 12)):
        op = f.ConsumeIntInRange(0, 7)
        try:
            if op == 0:
                s.add_request(an_int(f), an_int(f))
            elif op == 1:
                rids = np.array([an_int(f) for _ in range(f.ConsumeIntInRange(0, 3))])
                s.append(rids)
            elif op == 2:
                b, k = f.ConsumeIntInRange(0, 3), f.ConsumeIntInRange(0, 4)
                rids = np.array([an_int(f) for _ in range(b)], dtype=np.int64)
                sel = np.array([[an_int(f) for _ in range(k)] for _ in range(b)], dtype=np.int64)
                # Page rows with counts (token mode mapped on the device), now and then.
                counts = None
                if f.ConsumeBool():
                    kc = k if f.ConsumeBool() else f.ConsumeIntInRange(0, 4)
                    counts = np.array(
                        [[f.ConsumeIntInRange(-3, 70) for _ in range(kc)] for _ in range(b)],
                        dtype=np.int32,
                    ).reshape(b, kc)
                plan, _ = s.plan(an_int(f), rids, sel.reshape(b, k), an_int(f), counts)
                s.ready(plan)
                s.finish(plan)
            elif op == 3:
                s.end_step()
            elif op == 4:
                s.finish_request(an_int(f))
            elif op == 5:
                testing.inject_faults(
                    s, f.PickValueInList(["load", "backup", "x"]), an_int(f), None
                )
            elif op == 6:
                # Ragged rows as CSR: offsets as arbitrary as the entries.
                b = f.ConsumeIntInRange(0, 3)
                rids = np.array([an_int(f) for _ in range(b)], dtype=np.int64)
                offsets = np.array([an_int(f) for _ in range(f.ConsumeIntInRange(0, 5))])
                entries = np.array([an_int(f) for _ in range(f.ConsumeIntInRange(0, 8))])
                counts = None
                if f.ConsumeBool():
                    counts = np.array(
                        [f.ConsumeIntInRange(-3, 70) for _ in range(f.ConsumeIntInRange(0, 8))],
                        dtype=np.int32,
                    )
                plan, _ = s.plan_csr(an_int(f), rids, offsets, entries, an_int(f), counts)
                s.ready(plan)
                s.finish(plan)
            else:
                s.extend(an_int(f), an_int(f))
        except st.InvariantError:
            raise  # a bug: a broken invariant, or a panic caught in the core
        except st.SparsetierError:
            pass
        s.validate()
    s.drain()
    s.validate()


def joined_ops(f: atheris.FuzzedDataProvider) -> None:
    """The joined scheduler's entry points: admissions with arbitrary tokens (shared prefixes
    included), prefill, waits, plans, ends with and without tokens, evictions."""
    import torch

    kv = st.PoolSpec("KV", 1, 1, 2, "bf16", 4, 24)
    kv_host = st.PoolSpec("KV", 2, 1, 2, "bf16", 4, 16)
    ik = st.PoolSpec("INDEXER", 2, 1, 2, "bf16", 4, 16)
    layout = f.PickValueInList(LAYOUTS)
    s = st.StepScheduler.joined(
        st.PageTransferBinding(torch.zeros(kv.shape(), dtype=torch.bfloat16), kv),
        st.PageTransferBinding(
            torch.zeros(kv_host.shape(layout), dtype=torch.bfloat16), kv_host, layout
        ),
        st.TransferEngine("cpu", threads=1),
        indexer_device=st.PageTransferBinding(torch.zeros(ik.shape(), dtype=torch.bfloat16), ik),
        indexer_host=st.PageTransferBinding(
            torch.zeros(ik.shape(layout), dtype=torch.bfloat16), ik, layout
        ),
        prefetch=f.ConsumeBool(),
    )
    prompts = [np.arange(1, 14), np.arange(1, 9)]
    for _ in range(f.ConsumeIntInRange(1, 12)):
        op = f.ConsumeIntInRange(0, 7)
        rid = f.ConsumeIntInRange(0, 4) if f.ConsumeBool() else an_int(f)
        try:
            if op == 0:
                base = prompts[f.ConsumeIntInRange(0, 1)]
                extra = [an_int(f) for _ in range(f.ConsumeIntInRange(0, 6))]
                s.admit(rid, np.concatenate([base, np.array(extra, dtype=np.int64)]))
            elif op == 1:
                s.extend(rid, an_int(f))
            elif op == 2:
                s.wait_prefix(rid, an_int(f))
            elif op == 3:
                k = f.ConsumeIntInRange(0, 3)
                sel = np.array([[an_int(f) for _ in range(k)]], dtype=np.int64)
                plan, _ = s.plan(an_int(f), np.array([rid]), sel, an_int(f))
                s.ready(plan)
                s.finish(plan)
            elif op == 4:
                toks = [an_int(f) for _ in range(f.ConsumeIntInRange(0, 20))]
                s.finish_request(rid, np.array(toks, dtype=np.int64) if f.ConsumeBool() else None)
            elif op == 5:
                s.evict_prefix(an_int(f), an_int(f))
            elif op == 6:
                s.append(np.array([rid]))
            else:
                s.end_step()
        except st.InvariantError:
            raise  # a bug: a broken invariant, or a panic caught in the core
        except st.SparsetierError:
            pass
        s.validate()
    s.drain()
    s.validate()


def one(data: bytes) -> None:
    f = atheris.FuzzedDataProvider(data)
    what = f.ConsumeIntInRange(0, 5)
    try:
        if what == 0:
            s = spec(f)
            s.token_offset(f.PickValueInList(LAYOUTS), an_int(f), an_int(f), an_int(f), an_int(f))
        elif what == 1:
            pools = [spec(f) for _ in range(f.ConsumeIntInRange(0, 3))]
            size = f.ConsumeFloat() if f.ConsumeBool() else None
            ratio = f.ConsumeFloat() if f.ConsumeBool() else None
            st.plan_stack(
                pools,
                hicache_size=size,
                hicache_ratio=ratio,
                layout=f.PickValueInList(LAYOUTS),
                io_backend=f.PickValueInList(BACKENDS),
                pp_size=an_int(f),
                device_reserve=an_int(f),
                host_reserve=an_int(f),
                swa_window=an_int(f) if f.ConsumeBool() else None,
            ).to_dict()
        elif what == 2:
            d = lowlevel.ResidencyDirectory(
                f.ConsumeIntInRange(1, 16), f.ConsumeIntInRange(1, 16), object_bytes=an_int(f)
            )
            for _ in range(f.ConsumeIntInRange(1, 12)):
                n = f.ConsumeIntInRange(0, 5)
                keys = np.array([[an_int(f) for _ in range(4)] for _ in range(n)], dtype=np.int64)
                op = f.ConsumeIntInRange(0, 5)
                try:
                    if op == 0:
                        d.allocate(keys.reshape(-1, 4))
                    elif op == 1:
                        r = d.resolve(keys.reshape(-1, 4))
                        for lp in r.loads:
                            (d.complete if f.ConsumeBool() else lambda t: d.fail(t, "x", True))(
                                lp.transfer_id
                            )
                        d.release(r.handle)
                    elif op == 2:
                        d.backup(keys.reshape(-1, 4))
                    elif op == 3:
                        d.complete(an_int(f))
                    elif op == 4:
                        d.evict(an_int(f))
                    else:
                        d.drop_namespace(an_int(f))
                except st.InvariantError:
                    raise  # a bug: a broken invariant, or a panic caught in the core
                except st.SparsetierError:
                    pass
                d.validate()
        elif what == 4:
            scheduler_ops(f)
        elif what == 5:
            joined_ops(f)
        else:
            s = st.PoolSpec("KV", 2, 1, 4, "fp32", 4, 6)
            import torch

            a, b = torch.zeros(s.shape()), torch.zeros(s.shape())
            n = f.ConsumeIntInRange(0, 6)
            src = [an_int(f) for _ in range(n)]
            dst = [an_int(f) for _ in range(f.ConsumeIntInRange(0, 6))]
            t = lowlevel.PreparedPageTransfer(
                st.PageTransferBinding(a, s),
                st.PageTransferBinding(b, s),
                src,
                dst,
                granularity="token" if f.ConsumeBool() else "page",
            )
            st.TransferEngine("cpu").submit(lowlevel.PageTransferGroup([t])).wait()
    except st.InvariantError:
        raise  # a bug: a broken invariant, or a panic caught in the core
    except st.SparsetierError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
