"""Fuzz target (atheris) for the planning code and the builder's checks: pool specs, stack
plans, transfer plans and directory operations fed with arbitrary values. Any failure must be
a typed `sparsetier.SparsetierError`; anything else (another exception, a crash) is a finding.

    python tests/fuzz/fuzz_entry_points.py -runs=20000     # bounded pass (CI runs one)
    python tests/fuzz/fuzz_entry_points.py -max_total_time=600
"""

import sys

import atheris
import numpy as np

with atheris.instrument_imports():
    import sparsetier as st

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
        op = f.ConsumeIntInRange(0, 6)
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
                plan, _ = s.plan(an_int(f), rids, sel.reshape(b, k), an_int(f))
                s.ready(plan)
                s.finish(plan)
            elif op == 3:
                s.end_step()
            elif op == 4:
                s.finish_request(an_int(f))
            elif op == 5:
                s.inject_faults(f.PickValueInList(["load", "backup", "x"]), an_int(f), None)
            else:
                s.extend(an_int(f), an_int(f))
        except st.SparsetierError:
            pass
        s.validate()
    s.drain()
    s.validate()


def one(data: bytes) -> None:
    f = atheris.FuzzedDataProvider(data)
    what = f.ConsumeIntInRange(0, 4)
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
            d = st.ResidencyDirectory(
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
                except st.SparsetierError:
                    pass
                d.validate()
        elif what == 4:
            scheduler_ops(f)
        else:
            s = st.PoolSpec("KV", 2, 1, 4, "fp32", 4, 6)
            import torch

            a, b = torch.zeros(s.shape()), torch.zeros(s.shape())
            n = f.ConsumeIntInRange(0, 6)
            src = [an_int(f) for _ in range(n)]
            dst = [an_int(f) for _ in range(f.ConsumeIntInRange(0, 6))]
            t = st.PreparedPageTransfer(
                st.PageTransferBinding(a, s),
                st.PageTransferBinding(b, s),
                src,
                dst,
                granularity="token" if f.ConsumeBool() else "page",
            )
            st.TransferEngine("cpu").submit(st.PageTransferGroup([t])).wait()
    except st.SparsetierError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
