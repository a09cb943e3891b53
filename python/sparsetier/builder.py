"""``build_sparse_stack``: host pools and allocators over the device pools of one pool group.

Every check lives in the Rust core (``plan_stack``, ``PoolSpec.from_tensor`` and
``PoolSpec.check_tensor``); this module only allocates torch tensors for what the plan says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparsetier._core import (
    HiCache,
    PageTransferBinding,
    Plan,
    PoolSpec,
    TransferEngine,
    plan_stack,
)
from sparsetier.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from sparsetier.l3 import StorageController

_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "uint8"}


@dataclass(frozen=True)
class DevicePool:
    """An existing device pool: ``tensor`` has shape
    ``[planes, layers, pages, page_size, heads, head_dim]`` (layer-first). A packed row format
    (``PoolSpec(row_parts=..., page_layout=...)``) cannot be read off a tensor: pass ``spec``
    for such a pool (the tensor is checked against it)."""

    component: str
    tensor: torch.Tensor
    spec: PoolSpec | None = None


@dataclass
class SparseStack:
    """What ``build_sparse_stack`` returns: the plan, the pools of both tiers (by component),
    the copy engine, and the hierarchical prefix cache that owns the pages of both tiers (one
    page index addresses every pool of a tier). The prefix cache is the one owner of pages on
    both tiers: there is no second allocator to mix with it."""

    plan: Plan
    device_pools: dict[str, torch.Tensor]
    host_pools: dict[str, torch.Tensor]
    engine: TransferEngine
    hicache: HiCache
    pinned: bool = field(default=False)
    #: The L3 tier's executor when ``storage_backend`` was given (call its ``poll()`` in the
    #: serving loop, ``close()`` at the end).
    storage: StorageController | None = field(default=None)

    @property
    def page_size(self) -> int:
        return self.plan.page_size

    @property
    def layout(self) -> str:
        return self.plan.layout

    @property
    def io_backend(self) -> str:
        return self.plan.io_backend


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, _TORCH_DTYPES[name])


def build_sparse_stack(
    pools: Sequence[PoolSpec | DevicePool | tuple[str, Any]],
    *,
    page_size: int | None = None,
    hicache_size: float | None = None,
    hicache_ratio: float | None = None,
    layout: str = "layer_first",
    io_backend: str = "cpu",
    write_policy: str = "write_through",
    storage_backend: str | None = None,
    storage_config: dict[str, Any] | None = None,
    load_end_layer: int | None = None,
    pp_size: int = 1,
    swa_window: int | None = None,
    device_reserve: int = 1,
    host_reserve: int = 0,
    pin_memory: bool | None = None,
) -> SparseStack:
    """Builds the host pools and allocators of one pool group.

    ``pools`` lists the device pools, KV anchor first, each as a :class:`PoolSpec` (the device
    tensor is allocated here) or an existing tensor (:class:`DevicePool` or a
    ``(component, tensor)`` pair). ``hicache_size`` is the host budget in decimal GB;
    ``hicache_ratio`` sizes host pages as device pages x ratio (default 2). Host pools are pinned
    when CUDA is available unless ``pin_memory`` says otherwise.

    ``storage_backend`` (``"file"`` or ``"mooncake"``) puts an L3 store under the host tier;
    ``storage_config`` holds its settings: ``write_policy`` (``"write_back"``, the default, or
    ``"write_through"``), ``salt`` (model version / LoRA, part of every page key),
    ``prefetch_policy`` (``"best_effort"``, ``"wait_complete"``, ``"timeout"``),
    ``prefetch_timeout``, ``chunk_pages``, ``write_ahead`` (the share of host pages kept clean
    under write-back), ``retry_interval``, and the backend's own (``path`` for ``file``;
    ``master``, ``metadata_server``, ``protocol``... for ``mooncake``).

    Raises :class:`sparsetier.ConfigError` naming the field, the value and what is allowed.
    """
    import torch

    specs: list[PoolSpec] = []
    given: dict[int, torch.Tensor] = {}
    for i, pool in enumerate(pools):
        if isinstance(pool, PoolSpec):
            specs.append(pool)
            continue
        component, tensor = (
            (pool.component, pool.tensor) if isinstance(pool, DevicePool) else _pair(i, pool)
        )
        spec = pool.spec if isinstance(pool, DevicePool) else None
        if spec is not None:
            if spec.component != component.upper():
                raise ConfigError.of(
                    f"pools[{i}].spec", spec.component, f"a {component.upper()} pool spec"
                )
            spec.check_tensor(tensor, field=f"pools[{i}].tensor")
        else:
            spec = PoolSpec.from_tensor(component, tensor, field=f"pools[{i}].tensor")
        specs.append(spec)
        given[i] = tensor
    plan = plan_stack(
        specs,
        page_size=page_size,
        hicache_size=hicache_size,
        hicache_ratio=hicache_ratio,
        layout=layout,
        io_backend=io_backend,
        write_policy=write_policy,
        storage_backend=storage_backend,
        load_end_layer=load_end_layer,
        pp_size=pp_size,
        device_reserve=device_reserve,
        host_reserve=host_reserve,
        swa_window=swa_window,
    )
    device_type = "cpu" if plan.io_backend == "cpu" else "cuda"
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError.of("io_backend", plan.io_backend, "'cpu' (no CUDA device is available)")
    if not any(pin_memory is v for v in (None, True, False)) or (
        pin_memory and not torch.cuda.is_available()
    ):
        allowed = "None, True or False" + (
            "" if torch.cuda.is_available() else " (no CUDA: not True)"
        )
        raise ConfigError.of("pin_memory", repr(pin_memory), allowed)
    device_pools: dict[str, torch.Tensor] = {}
    for i, spec in enumerate(specs):
        if i in given:
            spec.check_tensor(given[i], "layer_first", device_type, f"pools[{i}].tensor")
            device_pools[spec.component] = given[i]
        else:
            dtype = _torch_dtype(spec.dtype)
            device_pools[spec.component] = torch.zeros(
                spec.shape(), dtype=dtype, device=device_type
            )
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    host_pools = {
        p.component: torch.empty(
            p.spec.shape(plan.layout),
            dtype=device_pools[p.component].dtype,
            pin_memory=pin,
        )
        for p in plan.pools
        if p.tier == "host"
    }
    engine = TransferEngine(plan.io_backend)
    device_plans = {p.component: p for p in plan.pools if p.tier == "device"}
    pairs = [
        (
            PageTransferBinding(device_pools[p.component], device_plans[p.component].spec),
            PageTransferBinding(host_pools[p.component], p.spec, plan.layout),
            p.window,
        )
        for p in plan.pools
        if p.tier == "host"
    ]
    hicache = HiCache(
        plan.page_size,
        plan.device_pages,
        host_pages=plan.host_pages,
        device_reserve=plan.device_reserve,
        host_reserve=plan.host_reserve,
        pools=pairs,
        engine=engine,
    )
    storage = None
    if plan.storage_backend is not None:
        storage = _storage(plan.storage_backend, dict(storage_config or {}), hicache, host_pools)
    elif storage_config:
        raise ConfigError.of("storage_config", sorted(storage_config), "None without a backend")
    return SparseStack(
        plan=plan,
        device_pools=device_pools,
        host_pools=host_pools,
        engine=engine,
        hicache=hicache,
        pinned=pin,
        storage=storage,
    )


def _storage(
    kind: str, cfg: dict[str, Any], hicache: HiCache, host_pools: dict[str, torch.Tensor]
) -> StorageController:
    from sparsetier import _checks
    from sparsetier.l3 import StorageController, make_backend

    # Every setting checked before the cache changes.
    write_policy = cfg.pop("write_policy", "write_back")
    if write_policy not in ("write_back", "write_through"):
        raise ConfigError.of("write_policy", repr(write_policy), "write_back or write_through")
    salt = _checks.text("salt", cfg.pop("salt", ""))
    write_ahead = _checks.real("write_ahead", cfg.pop("write_ahead", 0.1), 0.0, 1.0)
    own = ("prefetch_policy", "prefetch_timeout", "chunk_pages", "retry_interval")
    ctl = {k: cfg.pop(k) for k in own if k in cfg}
    StorageController.check_settings(**ctl)
    backend = make_backend(kind, cfg)
    try:
        hicache.enable_storage(write_policy=write_policy, salt=salt, write_ahead=write_ahead)
        buffers = [(t.data_ptr(), t.numel() * t.element_size()) for t in host_pools.values()]
        return StorageController(hicache, backend, host_buffers=buffers, **ctl)
    except BaseException:
        backend.close()  # (a Mooncake client holds a segment of the store)
        raise


def _pair(i: int, pool: Any) -> tuple[str, Any]:
    if isinstance(pool, tuple) and len(pool) == 2:
        return pool[0], pool[1]
    raise ConfigError.of(
        f"pools[{i}]", repr(pool), "a PoolSpec, a DevicePool or a (component, tensor) pair"
    )
