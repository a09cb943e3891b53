"""build_sparse_stack and plan_stack: the host budget, and one test per refusal."""

import pytest
import torch

from sparsetier import ConfigError, DevicePool, PoolSpec, build_sparse_stack, plan_stack

GIB = 1 << 30


def kv(pages=16, page_size=16):
    return PoolSpec("KV", 2, 2, 32, "bf16", page_size, pages)


def ik(pages=16, page_size=16):
    return PoolSpec("INDEXER", 2, 1, 64, "bf16", page_size, pages)


def test_source_budget_example():
    # Device: 8 GiB of KV, 2 GiB of Indexer-K; host budget 30 GiB. KV gets 24 GiB, Indexer-K
    # mirrors its page count at 6 GiB, and both cover the same token slots.
    kv_dev = PoolSpec("KV", 1, 8, 128, "bf16", 64, 32768)
    ik_dev = PoolSpec("INDEXER", 1, 4, 128, "bf16", 64, 32768)
    assert (kv_dev.total_bytes, ik_dev.total_bytes) == (8 * GIB, 2 * GIB)
    plan = plan_stack([kv_dev, ik_dev], hicache_size=30 * GIB / 1e9)
    host = [p for p in plan.pools if p.tier == "host"]
    assert host[0].pages == host[1].pages
    assert host[0].tokens == host[1].tokens
    assert abs(host[0].bytes - 24 * GIB) <= host[0].page_bytes
    assert abs(host[1].bytes - 6 * GIB) <= host[1].page_bytes
    # decimal GB: target and actual differ by less than one page of every pool
    assert (
        0
        <= plan.target_bytes - plan.actual_bytes
        < kv_dev.page_bytes_all_layers + ik_dev.page_bytes_all_layers
    )


def test_ratio_and_reserve_pages_make_tokens_differ_from_bytes():
    plan = plan_stack([kv(101), ik(101)], hicache_ratio=2.0, device_reserve=1, host_reserve=2)
    d = plan.to_dict()
    assert d["totals"]["device"] == {
        "pages": 101,
        "tokens": 100 * 16,
        "bytes": plan.pools[0].bytes + plan.pools[1].bytes,
    }
    assert d["totals"]["host"]["pages"] == 202
    assert d["totals"]["host"]["tokens"] == 200 * 16  # two reserve pages hold no tokens
    assert d["budget"]["actual_bytes"] == plan.actual_bytes


def test_build_from_specs_makes_pools_and_the_prefix_cache():
    stack = build_sparse_stack([kv(), ik()], hicache_ratio=2.0, layout="layer_page_first")
    assert set(stack.device_pools) == set(stack.host_pools) == {"KV", "INDEXER"}
    assert stack.device_pools["KV"].shape == (2, 2, 16, 16, 2, 32)
    assert stack.host_pools["KV"].shape == (2, 30, 2, 16, 2, 32)  # [plane][page][layer]...
    assert stack.host_pools["INDEXER"].shape == (1, 30, 2, 16, 1, 64)
    assert stack.hicache.stats()["device_capacity"] == 15
    assert stack.hicache.stats()["host_capacity"] == 30
    assert stack.pinned == torch.cuda.is_available()


def test_build_from_tensors():
    k = torch.zeros(kv().shape(), dtype=torch.bfloat16)
    i = torch.zeros(ik().shape(), dtype=torch.bfloat16)
    stack = build_sparse_stack([DevicePool("KV", k), ("INDEXER", i)], hicache_ratio=1.0)
    assert stack.device_pools["KV"] is k
    assert stack.plan.page_size == 16
    assert stack.host_pools["INDEXER"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"storage_backend": "s3"}, "storage_backend"),
        ({"load_end_layer": 3}, "load_end_layer"),
        ({"pp_size": 2}, "pp_size"),
        ({"write_policy": "write_back"}, "write_policy"),
        ({"layout": "page_first"}, "layout"),
        ({"io_backend": "nixl"}, "io_backend"),
        ({"page_size": 32}, "pools[0].page_size"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": -16}, "page_size"),
        ({"hicache_size": 1e-9}, "hicache_size"),
        ({"hicache_size": -2.0}, "hicache_size"),
        ({"hicache_ratio": 0.0}, "hicache_ratio"),
        ({"hicache_ratio": float("nan")}, "hicache_ratio"),
        ({"hicache_size": 1.0, "hicache_ratio": 2.0}, "hicache_ratio"),
        ({"device_reserve": 16}, "device_reserve"),
        ({"swa_window": 128}, "swa_window"),
        ({"hicache_size": "big"}, "hicache_size"),
    ],
)
def test_builder_refusals_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([kv(), ik()], **kwargs)
    assert e.value.field == field
    assert e.value.allowed
    assert field in str(e.value)


def test_mismatched_page_sizes_between_pools():
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([kv(page_size=16), ik(page_size=64)])
    assert e.value.field == "pools[1].page_size"
    assert e.value.value == "64"


def test_anchor_and_component_rules():
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([ik(), kv()])
    assert e.value.field == "pools[0].component"
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([kv(), ik(), ik()])
    assert e.value.field == "pools[2].component"
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([kv(), ik(pages=8)])
    assert e.value.field == "pools[1].pages"
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([])
    assert e.value.field == "pools"
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([kv(), "INDEXER"])
    assert e.value.field == "pools[1]"


def test_kernel_backend_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the cpu-only refusal cannot happen here")
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([kv(), ik()], io_backend="kernel")
    assert e.value.field == "io_backend"


def good_tensor():
    return torch.zeros(kv().shape(), dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("tensor", "field"),
    [
        (torch.zeros(kv().shape(), dtype=torch.int32), "pools[0].tensor.dtype"),
        (torch.zeros((2, 2, 16, 16, 64)), "pools[0].tensor.shape"),
        (good_tensor().transpose(4, 5), "pools[0].tensor.is_contiguous()"),
        (
            torch.zeros((2, 2, 0, 16, 2, 32), dtype=torch.bfloat16),
            "pools[0].tensor.shape[2] (pages)",
        ),
        ("not a tensor", "pools[0].tensor"),
    ],
)
def test_bad_tensors_are_refused(tensor, field):
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([("KV", tensor)])
    assert e.value.field == field


def test_wrong_device_is_refused():
    t = good_tensor().to("meta")
    with pytest.raises(ConfigError) as e:
        build_sparse_stack([("KV", t)])
    assert e.value.field == "pools[0].tensor.device"
    assert e.value.value == "meta"


def test_host_pool_dtype_check():
    spec = kv()
    with pytest.raises(ConfigError) as e:
        spec.check_tensor(torch.zeros(spec.shape(), dtype=torch.float16), field="host")
    assert e.value.field == "host.dtype"
    with pytest.raises(ConfigError) as e:
        spec.check_tensor(good_tensor(), layout="layer_page_first")
    assert e.value.field == "tensor.shape"
