"""Pool geometry: the source's numbers come out exactly, and bad sizes are refused."""

import pytest

from sparsetier import ConfigError, PoolSpec


def test_source_page_sizes():
    # 64-token pages; 8 KV heads x 128 dims x 2 planes x bf16 = 4096 B per token per layer.
    kv = PoolSpec("KV", 1, 8, 128, "bf16", 64, 100)
    ik = PoolSpec("INDEXER", 1, 1, 128, "bf16", 64, 100)
    assert kv.token_bytes_all_layers == 4096
    assert ik.token_bytes_all_layers == 256
    assert kv.page_bytes_all_layers == 256 * 1024
    assert ik.page_bytes_all_layers == 16 * 1024
    assert kv.token_slots == ik.token_slots == 6400


def test_welm_indexer_is_256_bytes_per_layer():
    for layers in (1, 30, 61):
        ik = PoolSpec("INDEXER", layers, 1, 128, "bf16", 64, 1)
        assert ik.token_bytes == 256
        assert ik.token_bytes_all_layers == 256 * layers


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"layers": 0}, "layers"),
        ({"layers": -3}, "layers"),
        ({"heads": 0}, "heads"),
        ({"head_dim": 2**40}, "head_dim"),
        ({"page_size": 0}, "page_size"),
        ({"pages": -1}, "pages"),
        ({"pages": 2**31, "layers": 2**20}, "pages"),
        ({"dtype": "int8"}, "dtype"),
        ({"component": "VALUE"}, "component"),
        ({"planes_per_layer": 3}, "planes_per_layer"),
        ({"layers": 1.5}, "layers"),
        ({"layers": True}, "layers"),
    ],
)
def test_bad_sizes_raise_config_error(kwargs, field):
    args = {"component": "KV", "layers": 2, "heads": 8, "head_dim": 128}
    args.update(kwargs)
    with pytest.raises(ConfigError) as e:
        PoolSpec(**args)
    assert e.value.field == field
    assert e.value.allowed
    assert field in str(e.value)
