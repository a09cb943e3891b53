"""Byte offsets from the Rust core against the strides of real torch tensors."""

import itertools

import pytest
import torch

from sparsetier import OutOfRangeError, PoolSpec

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3": torch.uint8,
}

# (component, layers, kv heads, head_dim, page_size, pages): GQA shapes store KV heads only.
SHAPES = [
    ("KV", 3, 8, 128, 64, 5),  # GQA: 8 KV heads for, say, 64 query heads
    ("KV", 2, 1, 64, 16, 7),  # MQA
    ("INDEXER", 4, 1, 128, 1, 9),  # K-only, page_size 1
    ("SWA", 2, 4, 32, 16, 3),
    ("DRAFT", 1, 2, 16, 64, 2),
]


def index(layout: str, plane: int, layer: int, page: int, token: int) -> tuple[int, ...]:
    if layout == "layer_first":
        return (plane, layer, page, token)
    return (plane, page, layer, token)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-ps{s[4]}")
@pytest.mark.parametrize("layout", ["layer_first", "layer_page_first"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_offsets_match_torch_strides(shape, layout, dtype):
    component, layers, heads, head_dim, page_size, pages = shape
    spec = PoolSpec(component, layers, heads, head_dim, dtype, page_size, pages)
    t = torch.empty(spec.shape(layout), dtype=DTYPES[dtype])
    assert t.numel() * t.element_size() == spec.total_bytes
    base = t.data_ptr()
    for plane, layer, page in itertools.product(
        range(spec.planes_per_layer), range(layers), range(pages)
    ):
        for token in {0, page_size // 2, page_size - 1}:
            want = t[index(layout, plane, layer, page, token)].data_ptr() - base
            assert spec.token_offset(layout, plane, layer, page, token) == want
        assert spec.page_offset(layout, plane, layer, page) == (
            t[index(layout, plane, layer, page, 0)].data_ptr() - base
        )


def test_planes_per_layer_default_by_component():
    assert PoolSpec("KV", 1, 1, 8).planes_per_layer == 2
    assert PoolSpec("INDEXER", 1, 1, 8).planes_per_layer == 1
    assert PoolSpec("KV", 1, 1, 8, planes_per_layer=1).planes_per_layer == 1  # MLA latent


def test_out_of_range_offsets_name_the_field():
    spec = PoolSpec("KV", 2, 1, 8, "bf16", 16, 4)
    for args, field in [
        ((2, 0, 0, 0), "plane"),
        ((0, 2, 0, 0), "layer"),
        ((0, 0, 4, 0), "page"),
        ((0, 0, 0, 16), "token"),
        ((0, -1, 0, 0), "layer"),
    ]:
        with pytest.raises(OutOfRangeError) as e:
            spec.token_offset("layer_first", *args)
        assert e.value.field == field
        assert "<" in e.value.allowed
