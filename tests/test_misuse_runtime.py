"""Misuse of the decode runtime and its tools (`DecodeRuntime`, `RuntimeMetrics`, the workload):
a bad argument is a ConfigError naming it, raised before anything changes, never a request let
go in Python that the core still holds, a silent misread, or a bare error from deep inside."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsetier.errors import ConfigError
from sparsetier.tools.model import ModelConfig, TinySparseModel
from sparsetier.tools.runtime import DecodeRuntime
from sparsetier.tools.workload import Workload, WorkloadSpec, as_tokens, load_stream

SMALL = dict(page_size=4, device_slots=64, host_pages=64, indexer_pages=32)


def _model():
    return TinySparseModel(ModelConfig(layers=1, vocab=64))


def _runtime(**kw):
    return DecodeRuntime(_model(), **{**SMALL, **kw})


@pytest.mark.parametrize("rid", [True, 1.0, np.float64(1.0), [1]])
@pytest.mark.parametrize("call", ["finish_request", "abort"])
def test_a_rid_that_only_equals_a_running_one_is_refused_and_it_keeps_running(call, rid):
    # Before: True == 1 and 1.0 == 1 found request 1; the runtime let it go, then the core
    # refused the id, so the core held its pages for a request Python no longer knew.
    rt = _runtime()
    rt.add_request(1, torch.arange(1, 10), 3)
    with pytest.raises(ConfigError) as e:
        getattr(rt, call)(rid)
    assert e.value.field == "rid"
    assert list(rt.requests) == [1] and not rt.ended
    rt.scheduler.validate()
    rt.step()  # still served
    rt.finish_request(1)
    rt.add_request(1, torch.arange(1, 10), 1)  # the id is free in the core too


@pytest.mark.parametrize("rid", [True, 1.0])
def test_restart_with_a_rid_that_only_equals_an_ended_one_keeps_it_restartable(rid):
    rt = _runtime()
    rt.add_request(1, torch.arange(1, 10), 3)
    rt.abort(1)
    with pytest.raises(ConfigError) as e:
        rt.restart(rid)
    assert e.value.field == "rid"
    assert list(rt.ended) == [1] and not rt.requests
    rt.restart(1)
    assert list(rt.requests) == [1]


def test_numpy_integers_are_request_ids_and_counts():
    rt = _runtime()
    rt.add_request(np.int64(2), torch.arange(1, 10), np.int64(1))
    assert list(rt.requests) == [2] and type(next(iter(rt.requests))) is int
    rt.step()
    assert rt.finish_request(np.int32(2)).rid == 2


@pytest.mark.parametrize(
    "field,value",
    [
        ("page_size", 0),
        ("device_slots", 0),
        ("host_pages", 2.0),
        ("indexer_pages", True),
        ("topk", 8.5),
        ("topk", float("nan")),
        ("window", -1),
        ("window", True),
        ("block_size", 0),
        ("block_size", 8.0),
        ("prefill_chunk", 2.5),
        ("prefill_chunk", True),
        ("prefill_chunk", "8"),
        ("keep_records", 2.5),
        ("keep_records", True),
        ("prefetch", "no"),
        ("reduce", "sum"),
        ("device", "nope"),
    ],
)
def test_bad_constructor_options_are_refused_up_front(field, value):
    # Before: some were read as another size (0 as the page size, True as 1), others refused
    # only by the first prefill, or by a bare ZeroDivisionError, TypeError or RuntimeError.
    with pytest.raises(ConfigError) as e:
        _runtime(**{field: value})
    assert e.value.field == field


def test_runtime_metrics_refuse_what_is_not_a_runtime():
    from sparsetier.tools.metrics import RuntimeMetrics

    # Before: accepted, and every scrape failed with an AttributeError.
    with pytest.raises(ConfigError) as e:
        RuntimeMetrics(None)
    assert e.value.field == "runtime"


SPEC = dict(num_prompts=4, sys_min=8, sys_max=16, min_len=20, max_len=40)


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_prompts", 0),
        ("num_prompts", True),
        ("zipf_a", float("nan")),
        ("max_len", 10),  # < min_len
        ("sys_max", 4),  # < sys_min
        ("min_len", 1.5),
        ("followup_frac", float("nan")),
        ("followup_frac", 2.0),
        ("vocab", 1),
        ("vocab", 2.5),
        ("seed", True),
        ("align", 0),
        ("align", 2.5),
    ],
)
def test_bad_workload_specs_are_refused(field, value):
    # Before: a NaN fraction meant no follow-ups, a float vocab or length was truncated, an
    # align of 0 meant 1, and the rest were numpy's ValueError or TypeError mid-stream.
    with pytest.raises(ConfigError) as e:
        WorkloadSpec(**{**SPEC, field: value})
    assert e.value.field == field


def test_bad_workload_and_stream_arguments_are_refused():
    with pytest.raises(ConfigError, match="spec"):
        Workload({"seed": 0})
    w = Workload(WorkloadSpec(**SPEC))
    for n, seed, field in [(-1, 0, "n"), (2.5, 0, "n"), (True, 0, "n"), (2, None, "stream_seed")]:
        with pytest.raises(ConfigError) as e:
            list(w.stream(n, seed))
        assert e.value.field == field
    assert len(list(w.stream(3, 1))) == 3


def test_as_tokens_refuses_what_its_container_would_misread():
    # Before: uint32 wrapped -1 to 4294967295 and 2**32 to 0, floats were truncated, and an
    # unknown kind was a bare ValueError.
    for kind, toks in [
        ("uint32", np.array([1, -1])),
        ("uint32", np.array([1, 2**32])),
        ("numpy", np.array([1.7, 2.2])),
        ("q", np.ones((2, 2), dtype=np.int64)),
    ]:
        with pytest.raises(ConfigError) as e:
            as_tokens(kind, toks)
        assert e.value.field == "toks"
    with pytest.raises(ConfigError) as e:
        as_tokens("NUMPY", np.arange(3))
    assert e.value.field == "kind"
    assert as_tokens("uint32", np.array([0, 2**32 - 1])).tolist() == [0, 2**32 - 1]
    assert as_tokens("list", [1, 2]) == [1, 2]


@pytest.mark.parametrize(
    "arrays,field",
    [
        (dict(tokens=np.arange(10), offsets=np.array([0, 4, 20])), "offsets"),  # past the end
        (dict(tokens=np.arange(10), offsets=np.array([0, 6, 4, 10])), "offsets"),  # decreasing
        (dict(tokens=np.arange(10), offsets=np.array([2, 4, 10])), "offsets"),  # drops tokens
        (dict(tokens=np.arange(10), offsets=np.array([0.0, 4.5, 10.0])), "offsets"),
        (dict(tokens=np.arange(10.0), offsets=np.array([0, 4, 10])), "tokens"),
        (dict(tokens=np.arange(10)), "path"),  # no offsets: a bare KeyError before
    ],
)
def test_load_stream_refuses_a_dump_it_would_misread(tmp_path, arrays, field):
    path = tmp_path / "s.npz"
    np.savez(path, **arrays)
    with pytest.raises(ConfigError) as e:
        load_stream(str(path))
    assert e.value.field == field


def test_load_stream_reads_a_dump_and_refuses_an_npy(tmp_path):
    np.savez(tmp_path / "s.npz", tokens=np.arange(10), offsets=np.array([0, 4, 4, 10]))
    assert [len(t) for t in load_stream(str(tmp_path / "s.npz"))] == [4, 0, 6]
    np.save(tmp_path / "x.npy", np.arange(3))
    with pytest.raises(ConfigError) as e:  # a bare IndexError before
        load_stream(str(tmp_path / "x.npy"))
    assert e.value.field == "path"
