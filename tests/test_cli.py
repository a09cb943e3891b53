"""`sparsetier plan`: the table, the JSON keys, and bad flags exiting with status 2."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import sparsetier as st
from sparsetier import lowlevel
from sparsetier.replay import load_trace
from sparsetier.tools.cli import main


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


SOURCE = [
    "plan",
    "--layers",
    "1",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--indexer-layers",
    "1",
    "--page-size",
    "64",
    "--device-pages",
    "100",
    "--device-reserve",
    "0",
]


def test_plan_reproduces_the_source_numbers(capsys):
    assert main([*SOURCE, "--hicache-ratio", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    kv, ik = out["pools"][0], out["pools"][1]
    assert (kv["component"], kv["tier"], kv["page_bytes"], kv["pages"], kv["tokens"]) == (
        "KV",
        "device",
        256 * 1024,
        100,
        6400,
    )
    assert (ik["component"], ik["page_bytes"], ik["tokens"]) == ("INDEXER", 16 * 1024, 6400)
    assert out["totals"]["device"]["bytes"] == 100 * (256 + 16) * 1024
    assert set(out["budget"]) == {"target_bytes", "actual_bytes"}
    for p in out["pools"]:
        assert set(p) >= {"component", "tier", "layout", "page_bytes", "pages", "tokens", "bytes"}
        assert p["tier"] in ("device", "host")


def test_plan_table(capsys):
    assert (
        main(
            [
                *SOURCE,
                "--hicache-size",
                "0.1",
                "--swa-window",
                "128",
                "--draft-layers",
                "1",
                "--layout",
                "layer_page_first",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for word in (
        "KV",
        "INDEXER",
        "SWA",
        "DRAFT",
        "layer_page_first",
        "host budget: target 100000000 B",
    ):
        assert word in out


def test_device_gb(capsys):
    assert (
        main(
            [
                "plan",
                "--layers",
                "61",
                "--kv-heads",
                "8",
                "--head-dim",
                "128",
                "--device-gb",
                "40",
                "--hicache-size",
                "200",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["totals"]["device"]["bytes"] <= 40e9
    assert out["budget"]["actual_bytes"] <= out["budget"]["target_bytes"] == 200 * 10**9


@pytest.mark.parametrize(
    "extra",
    [
        ["--layout", "page_first"],
        ["--io-backend", "gds"],
        ["--hicache-size", "-1"],
        ["--hicache-ratio", "0"],
        ["--page-size", "0"],
        ["--dtype", "int4"],
        ["--device-reserve", "100"],
        ["--hicache-size", "1e-9"],
    ],
)
def test_bad_flags_exit_2_with_the_message(extra):
    r = subprocess.run(
        [sys.executable, "-m", "sparsetier.tools.cli", *SOURCE, *extra],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "error: invalid" in r.stderr and "allowed" in r.stderr


SHAPE = ["plan", "--layers", "4", "--kv-heads", "1", "--head-dim", "64", "--device-pages", "8"]
MODEL = ["plan", "--model", "deepseek-v3.2", "--device-gb", "80"]


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        # (Before: these ran, the flag ignored or named as another, or a traceback.)
        ([*MODEL, "--page-size", "32"], "page_size"),
        ([*MODEL, "--indexer-head-dim", "64"], "indexer_head_dim"),
        ([*MODEL, "--draft-layers", "1"], "draft_layers"),
        (["plan", "--model", "deepseek-v3.2", "--device-gb", "inf"], "device_gb"),
        ([*SHAPE, "--topk", "5"], "topk"),
        ([*SHAPE, "--swa-layers", "2"], "swa_layers"),
        ([*SHAPE, "--indexer-layers", "-1"], "indexer_layers"),
        ([*SHAPE, "--draft-layers", "-1"], "draft_layers"),
        ([*SHAPE[:-1], "0"], "device_pages"),
        (["bench", "prefix-sparse", "--json", "/nonexistent-dir/x.json"], "json"),
        (["bench", "prefix-sparse", "--selections", "/nonexistent-dir/s.npz"], "selections"),
        (["demo", "--plot", "/nonexistent-dir/p.png"], "plot"),
        (["replay", "/nonexistent-dir/t.npz"], "trace"),
        (["bench", "vllm", "--requests", "0"], "requests"),
        (["bench", "vllm", "--pool-requests", "nan"], "pool_requests"),
        (["bench", "vllm", "--kv-groups", "0"], "kv_groups"),
        (["bench", "vllm", "--requests", "1"], "requests"),
        (["bench", "prefix", "--containers", "--max-len", "9"], "max_len"),
        (["bench", "vllm", "--prefix-blocks", "-1"], "prefix_blocks"),
        (["bench", "prefix", "--followup-frac", "7"], "followup_frac"),
        (["bench", "prefix", "--reps", "3"], "reps"),
        (["bench", "decode", "--resolve", "device", "--kernel-threads", "-1"], "kernel_threads"),
        (["bench", "prefix-sparse", "--page-size", "0"], "page_size"),
        (["bench", "prefix-sparse", "--measure-max-prefix", "8192"], "measure_max_prefix"),
        (["demo", "--seed", "-1"], "seed"),
        (["demo", "--token-map", "device"], "token_map"),
    ],
)
def test_a_flag_that_would_be_ignored_misnamed_or_fail_late_is_refused_first(argv, field, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"invalid {field} = " in err and "allowed" in err, err


@pytest.mark.parametrize("what", ["decode", "prefix"])
def test_bench_page_size_zero_is_refused_not_replaced(what):
    # 0 is a value the user gave, not "unset": it must be refused, not swapped for a default.
    r = subprocess.run(
        [sys.executable, "-m", "sparsetier.tools.cli", "bench", what, "--page-size", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2, r.stdout[-500:]
    assert "Traceback" not in r.stderr
    assert "page_size" in r.stderr and "allowed" in r.stderr


def test_each_benchmark_takes_only_its_own_flags(capsys):
    # `bench` has a subcommand per benchmark: a flag of another one is an error, not ignored.
    with pytest.raises(SystemExit) as e:
        main(["bench", "directory", "--mode", "token"])
    assert e.value.code == 2
    assert "unrecognized arguments: --mode" in capsys.readouterr().err


def test_bench_prefix_against_sglang_needs_a_peers_dir(monkeypatch, capsys):
    # No default path outside the repository: the peer scripts' folder is given or refused.
    monkeypatch.delenv("SPARSETIER_PEERS_DIR", raising=False)
    assert main(["bench", "prefix", "--peers-python", sys.executable, "--num-seqs", "2"]) == 2
    assert "peers_dir" in capsys.readouterr().err


def test_unknown_flag_exits_2():
    r = subprocess.run(
        [sys.executable, "-m", "sparsetier.tools.cli", "plan", "--bogus"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_bench_directory_runs_and_reports_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(["bench", "directory", "--batches", "64", "--hit-rates", "0.5", "--json", str(out)])
        == 0
    )
    assert "python/rust" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert len(rows) == 1
    assert rows[0]["batch"] == 64 and rows[0]["ratio"] > 0


def test_bench_bad_flags_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "sparsetier.tools.cli", "bench", "directory", "--hit-rates", "1.5"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2
    assert "hit_rates" in r.stderr and "Traceback" not in r.stderr


def test_bench_transfer_cpu_runs_with_ratios(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert (
        main(["bench", "transfer", "--device", "cpu", "--total-mb", "4", "--json", str(out)]) == 0
    )
    assert "memcpy" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert {r["pattern"] for r in rows} == {"contiguous", "scattered", "token"}
    assert {r["page_bytes"] for r in rows} == {4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20}
    assert all(r["gbps"] > 0 and r["ratio"] > 0 for r in rows)


def test_bench_transfer_cuda_without_gpu_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the cuda bench would run")
    r = subprocess.run(
        [sys.executable, "-m", "sparsetier.tools.cli", "bench", "transfer", "--device", "cuda"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "CUDA" in r.stderr


def test_bench_prefix_runs_and_matches_the_rust_loop(tmp_path, capsys):
    out = tmp_path / "p.json"
    args = ["bench", "prefix", "--page-size", "16", "--num-seqs", "40", "--num-queries", "10"]
    assert main([*args, "--serve-reqs", "40", "--json", str(out)]) == 0
    assert "serve hit fraction" in capsys.readouterr().out
    r = json.loads(out.read_text())["sparsetier"]
    # the binding's loop and the Rust loop make the same decisions on the same stream
    assert r["serve"]["hit_frac"] == r["serve.rust_alone"]["hit_frac"] > 0
    assert r["serve"]["failed"] == r["serve.rust_alone"]["failed"]


def test_demo_passes_and_writes_json_and_plot(tmp_path, capsys):
    j, p = tmp_path / "d.json", tmp_path / "d.png"
    args = ["demo", "--requests", "3", "--concurrent", "2", "--steps", "6", "--context-min", "64",
            "--context-max", "160", "--page-size", "8", "--topk", "3", "--quiet"]  # fmt: skip
    assert main([*args, "--json", str(j), "--plot", str(p)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "read amplification" in out
    r = json.loads(j.read_text())
    assert r["totals"]["correct"] is True
    assert r["totals"]["steps"] == len(r["steps"]) > 0
    assert p.stat().st_size > 1000


SMALL_DEMO = (
    "demo --requests 3 --concurrent 2 --steps 6 --context-min 64 --context-max 160 "
    "--page-size 8 --topk 3 --quiet"
).split()


@pytest.mark.parametrize(
    "extra",
    [["--selection", "token", "--topk-tokens", "24"], ["--block-size", "16", "--no-prefetch"],
     ["--selection", "token", "--topk-tokens", "24", "--token-map", "device"]],
)  # fmt: skip
def test_demo_selection_modes_pass(extra, capsys):
    args = [*SMALL_DEMO, *extra]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "PASS" in out
    # With prefetch off the summary says so, not an accuracy of a prediction never made.
    assert ("off (--no-prefetch)" in out) == ("--no-prefetch" in extra)
    assert ("accuracy" in out) == ("--no-prefetch" not in extra)


def test_demo_with_faults_reports_them_and_ends_clean(tmp_path, capsys):
    j = tmp_path / "f.json"
    args = ["demo", "--requests", "6", "--concurrent", "3", "--steps", "24", "--context-min",
            "128", "--context-max", "256", "--page-size", "8", "--topk", "3", "--quiet",
            "--faults", "--json", str(j)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "failed loads" in out
    t = json.loads(j.read_text())["totals"]
    assert t["failed_loads"] >= 2 and t["retried_loads"] >= 1 and t["failed_backups"] == 1
    # Every armed fault failed a transfer of its kind or is reported unused, never lost:
    # --faults arms 3 load faults, 1 backup fault and 1 restore fault.
    unused = t["faults_unused"]
    assert t["failed_loads"] + unused.get("loads", 0) == 3
    assert t["failed_backups"] + unused.get("backups", 0) == 1
    assert t["failed_restores"] + unused.get("restores", 0) == 1
    assert t["failures"], "the layer whose load and retry fail must fail some request"
    # On the cpu engine the single load fault is a copy worker's panic, taken as a failure.
    assert t["copy_panics"] == 1 and "1 of them a copy worker's panic" in out
    assert (t["end_pins"], t["end_quarantined_slots"], t["end_device_leaked"]) == (0, 0, 0)
    assert t["end_transfers_in_flight"] == 0


def test_the_default_demo_with_faults_fails_a_restore_from_host_too(tmp_path, capsys):
    # The layer that fails twice waits for a follow-up turn: failing only first turns would
    # end their conversations before a prefix hit restored from host, and the restore fault
    # armed at step 1 would go unused (it did in block mode while that layer failed at step 9).
    j = tmp_path / "d.json"
    assert main(["demo", "--faults", "--quiet", "--json", str(j)]) == 0
    assert "PASS" in capsys.readouterr().out
    t = json.loads(j.read_text())["totals"]
    assert t["failed_restores"] == 1 and not t["faults_unused"], t["faults_unused"]
    assert (t["end_pins"], t["end_quarantined_slots"], t["end_device_leaked"]) == (0, 0, 0)


@pytest.mark.parametrize("selection", ["block", "token"])
def test_demo_restarts_failed_requests_and_still_matches_the_resident_run(
    selection, tmp_path, capsys
):
    # "The runtime then ends or restarts those requests": with --restart-failed the runtime
    # restarts each failed request once (`DecodeRuntime.restart`), the resident run restarts
    # the same ones at the same points, and every output (the restarted requests' whole runs
    # included) is still bit-identical.
    j = tmp_path / "r.json"
    args = ["demo", "--requests", "6", "--concurrent", "3", "--steps", "24", "--quiet",
            "--selection", selection, "--faults", "--restart-failed", "--json", str(j)]  # fmt: skip
    assert main(args) == 0
    assert "PASS" in capsys.readouterr().out
    r = json.loads(j.read_text())
    t = r["totals"]
    assert t["correct"] and t["failed_requests_list"]
    failed = sorted({f["rid"] for f in t["failures"]})
    assert sorted(t["restarted"]) == failed  # each failed request, once
    # Every conversation ran all its turns, as in the same run without faults.
    assert main([a for a in args if a not in ("--faults", "--restart-failed")]) == 0
    capsys.readouterr()
    clean = json.loads(j.read_text())["totals"]
    assert (t["requests"], clean["failed_requests_list"]) == (clean["requests"], [])
    assert (t["end_pins"], t["end_quarantined_slots"], t["end_device_leaked"]) == (0, 0, 0)


@pytest.mark.parametrize("mode", ["block", "token"])
def test_bench_decode_runs_both_sides(mode, tmp_path, capsys):
    out = tmp_path / "d.json"
    args = ["bench", "decode", "--mode", mode, "--layers", "3", "--batch", "4", "--context-min",
            "1024", "--context-max", "2048", "--steps", "3", "--tokens", "128", "--token-pages",
            "16", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "ratio" in text and "ms CPU per step" in text
    r = json.loads(out.read_text())
    assert len(r["steps"]) == 3 and r["median"]["scheduler_ms"] > 0
    assert r["median"]["pages"] > 0
    # The page sizes the run could get go with its figures (they move them).
    assert r["memory"].startswith("THP ") and f"memory pages: {r['memory']}" in text


def test_bench_decode_says_whether_the_allocator_was_given_huge_pages(monkeypatch):
    from sparsetier.tools.bench_decode import _memory_pages

    monkeypatch.delenv("MIMALLOC_ALLOW_LARGE_OS_PAGES", raising=False)
    assert _memory_pages().endswith("large OS pages off")
    monkeypatch.setenv("MIMALLOC_ALLOW_LARGE_OS_PAGES", "0")
    assert _memory_pages().endswith("large OS pages off")
    monkeypatch.setenv("MIMALLOC_ALLOW_LARGE_OS_PAGES", "1")
    assert _memory_pages().endswith("large OS pages on")


def test_bench_decode_maps_tokens_on_a_device_as_a_fourth_stack(tmp_path, capsys):
    out = tmp_path / "d.json"
    args = ["bench", "decode", "--mode", "token", "--layers", "2", "--batch", "3",
            "--context-min", "512", "--context-max", "1024", "--steps", "3", "--tokens", "64",
            "--token-pages", "8", "--no-baseline", "--no-unkept", "--map-device", "cpu",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "tokens mapped to pages on cpu" in text
    r = json.loads(out.read_text())
    for step in r["steps"]:
        assert step["mapped_ms"] > 0 and step["mapped_core_cpu_ms"] > 0
        assert step["core_d2h_ms"] >= 0 and step["mapped_ratio"] > 0
        # Moved / needed among moved: at least 1 where anything moved (which pages each stack
        # loads depends on when its write-throughs landed, so the stacks are not compared).
        rm = step["mapped_read_amplification"]
        assert rm is None or rm >= 1.0
    with pytest.raises(SystemExit):
        main(["bench", "decode", "--mode", "token", "--map-device", "tpu"])
    assert main(["bench", "decode", "--mode", "block", "--map-device", "cpu"]) == 2


def test_bench_json_to_a_jsonl_path_collects_runs(tmp_path):
    small = ["bench", "decode", "--layers", "2", "--batch", "3", "--context-min", "512",
             "--context-max", "1024", "--steps", "2", "--warmup", "1", "--no-baseline"]  # fmt: skip
    lines, whole = tmp_path / "runs.jsonl", tmp_path / "run.json"
    for locality in ("0.5", "0.9"):
        for path in (lines, whole):
            assert main([*small, "--locality", locality, "--json", str(path)]) == 0
    runs = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [r["config"]["locality"] for r in runs] == [0.5, 0.9]
    # Any other path holds the last run, indented as before.
    assert json.loads(whole.read_text())["config"]["locality"] == 0.9


def test_bench_decode_times_the_scheduler_alone_after_the_paired_steps(tmp_path, capsys):
    small = ["bench", "decode", "--layers", "2", "--batch", "3", "--context-min", "512",
             "--context-max", "1024", "--steps", "3", "--warmup", "1"]  # fmt: skip
    out = tmp_path / "d.json"
    assert main([*small, "--alone-steps", "4", "--json", str(out)]) == 0
    assert "step scheduler alone" in capsys.readouterr().out
    r = json.loads(out.read_text())
    alone = r["alone"]
    assert len(alone["steps"]) == 4 and alone["scheduler_ms"] > 0 and alone["core_ms"] > 0
    # The spread brackets the median: the fewest and most of the four steps here.
    ms = sorted(s["ms"] for s in alone["steps"])
    assert alone["spread_ms"] == [ms[0], ms[-1]]
    lo, hi = r["spread"]["scheduler_ms"]
    assert lo <= r["median"]["scheduler_ms"] <= hi
    # None asked for, or nothing ran between the scheduler's steps anyway: no second figure.
    for extra in (["--alone-steps", "0"], ["--no-baseline", "--no-unkept"]):
        assert main([*small, *extra, "--json", str(out)]) == 0
        assert "alone" not in capsys.readouterr().out
        assert json.loads(out.read_text())["alone"] is None
    assert main([*small, "--alone-steps", "-1"]) == 2


@pytest.mark.parametrize("mode", ["block", "token"])
def test_bench_decode_hands_rows_over_as_int32_and_plans_them_alike(mode, tmp_path, capsys):
    small = ["bench", "decode", "--mode", mode, "--layers", "2", "--batch", "3",
             "--context-min", "512", "--context-max", "1024", "--steps", "3", "--warmup", "1",
             "--tokens", "64", "--token-pages", "8", "--alone-steps", "0"]  # fmt: skip
    runs = {}
    for dtype in ("int64", "int32"):
        out = tmp_path / f"{dtype}.json"
        assert main([*small, "--entry-dtype", dtype, "--json", str(out)]) == 0
        assert f"rows as {dtype}" in capsys.readouterr().out
        runs[dtype] = json.loads(out.read_text())
    # The same selections, the same pages every step, on every stack (the baseline's hits too).
    for key in ("pages", "hit_rate", "unkept_hit_rate"):
        assert [s[key] for s in runs["int64"]["steps"]] == [s[key] for s in runs["int32"]["steps"]]
    with pytest.raises(SystemExit):
        main([*small, "--entry-dtype", "int16"])
    from sparsetier.tools import bench_decode

    with pytest.raises(st.ConfigError) as e:
        bench_decode.DecodeBenchConfig(entry_dtype="int16").check()
    assert e.value.field == "entry_dtype"
    sel = np.arange(6, dtype=np.int64).reshape(1, 2, 3)
    for dtype in ("int64", "int32"):
        given = bench_decode.as_given(bench_decode.DecodeBenchConfig(entry_dtype=dtype), sel)
        assert given.dtype == np.dtype(dtype) and (given == sel).all()


def test_bench_decode_names_its_engine_and_refuses_a_gpu_engine_without_a_gpu(capsys):
    args = ["bench", "decode", "--layers", "2", "--batch", "3", "--context-min", "512",
            "--context-max", "1024", "--steps", "2", "--no-baseline", "--no-unkept"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert ", cpu engine" in out
    # A shape this small gets more device slots than its budget: the report says so.
    assert "device budget 25% raised to" in out
    if not torch.cuda.is_available():
        assert main([*args, "--io-backend", "kernel"]) == 2
        assert "io_backend" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: torch sees none")
@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_bench_decode_on_a_cuda_engine_waits_on_the_stream(io, tmp_path, capsys):
    out = tmp_path / "d.json"
    args = ["bench", "decode", "--layers", "3", "--batch", "4", "--context-min", "1024",
            "--context-max", "2048", "--steps", "3", "--io-backend", io,
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    assert f", {io} engine" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert sum(s["loaded"] for s in r["steps"]) > 0 or r["warmup_loaded"] > 0
    # `ready` is a stream wait: the scheduler never blocks the CPU on a load.
    assert all(s["scheduler_wait_ms"] == 0 for s in r["steps"])


def test_bench_decode_reports_no_read_amplification_when_nothing_moves(tmp_path, capsys):
    # Locality 1 with a budget that holds every selection: after the warm-up every page is
    # read from the device. Nothing moved, so seed 002's ratio (moved / needed among moved)
    # has no value: None in the JSON, "n/a" in the report, never a 0 below its floor of 1.
    out = tmp_path / "d.json"
    args = ["bench", "decode", "--layers", "2", "--batch", "3", "--context-min", "512",
            "--context-max", "1024", "--steps", "3", "--no-baseline", "--no-unkept",
            "--locality", "1.0", "--budget", "0.9", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "read amplification n/a (nothing moved)" in text
    r = json.loads(out.read_text())
    assert all(s["loaded"] == 0 and s["read_amplification"] is None for s in r["steps"])
    assert r["median"]["read_amplification"] is None
    assert r["median"]["hit_rate"] == 1.0


def test_bench_decode_times_the_steady_state_after_the_device_turns_over(tmp_path, capsys):
    # The prefill leaves its pages resident in the order it wrote them; a step that evicts
    # those is cheaper than one evicting pages loaded at random. By default the timed steps
    # start once the scheduler has loaded as many pages as the device has slots.
    out = tmp_path / "d.json"
    small = ["bench", "decode", "--layers", "2", "--batch", "3", "--context-min", "8192",
             "--context-max", "16384", "--steps", "2", "--no-baseline", "--no-unkept",
             "--json", str(out)]  # fmt: skip
    assert main(small) == 0
    assert "warm-up: " in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["warmup_loaded"] >= r["device_pages"] > 0 and r["warmup_steps"] >= 2
    assert "until the device turned over" in r["warmup"] and len(r["steps"]) == 2
    assert main([*small, "--warmup", "1"]) == 0
    r = json.loads(out.read_text())
    assert r["warmup_steps"] == 1 and "fixed" in r["warmup"]


def test_warm_up_ends_at_turnover_at_a_quiet_step_or_at_its_cap(monkeypatch):
    from sparsetier.tools import bench_decode as bd

    def steps_until_done(cfg, loads):
        w = bd.WarmUp(cfg, device_pages=100)
        for n in loads:
            if w.done():
                break
            w.saw({"loaded": n})
        return w.steps, w.ended

    auto = bd.DecodeBenchConfig()
    assert steps_until_done(auto, [60, 30, 9, 1, 50]) == (4, "until the device turned over")
    assert steps_until_done(auto, [0, 5, 0, 7]) == (3, "until a step loaded nothing")
    monkeypatch.setattr(bd, "WARMUP_CAP", 3)
    assert steps_until_done(auto, [1] * 10) == (3, "capped before the device turned over")
    assert steps_until_done(bd.DecodeBenchConfig(warmup=2), [500] * 5) == (2, "fixed")
    assert steps_until_done(bd.DecodeBenchConfig(warmup=0), [500]) == (0, "fixed")


def test_bench_decode_writes_a_trace_the_replay_reproduces(tmp_path, capsys):
    trace = tmp_path / "b.npz"
    args = ["bench", "decode", "--layers", "2", "--batch", "3", "--context-min", "512",
            "--context-max", "1024", "--steps", "3", "--no-baseline",
            "--trace", str(trace)]  # fmt: skip
    assert main(args) == 0
    t = load_trace(str(trace))
    r = lowlevel.replay_trace(t, t["device_slots"], "lru")
    assert r["feasible"] and r["accesses"] > 0
    assert lowlevel.replay_trace(t, t["device_slots"], "min")["hits"] >= r["hits"]


NO_GPU = [] if torch_cuda() else [["--device", "cuda"]]


@pytest.mark.parametrize(
    "extra",
    [
        ["--budget", "0"],
        ["--topk", "1"],
        ["--device", "tpu"],
        ["--block-size", "12"],
        *NO_GPU,
    ],
)
def test_demo_bad_flags_exit_2(extra):
    r = subprocess.run(
        [sys.executable, "-m", "sparsetier.tools.cli", "demo", "--quiet", *extra],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "allowed" in r.stderr


def test_plan_estimates_a_prefix_hit_for_deepseek_v32(capsys):
    # 656 B/token/layer main KV and 132 B Indexer-K (FP8), top-2048 of a 32k prefix: the
    # joined mode moves Indexer-K plus one step's selection, about 4.55x less than all of it.
    args = ["plan", "--layers", "61", "--kv-heads", "1", "--head-dim", "328", "--dtype",
            "fp8_e4m3", "--indexer-head-dim", "132", "--indexer-dtype", "fp8_e4m3",
            "--device-pages", "100", "--context", "32768", "--topk", "2048", "--json"]  # fmt: skip
    assert main(args) == 0
    e = json.loads(capsys.readouterr().out)["prefix_hit_estimate"]
    assert e["full_restore_bytes"] == 32768 * 61 * (656 + 132)
    assert e["joined_bytes_ideal"] == 61 * (32768 * 132 + 2048 * 656)
    assert e["ratio_ideal"] == pytest.approx(4.55, abs=0.01)
    assert main(["plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "8",
                 "--device-pages", "4", "--context", "0"]) == 2  # fmt: skip


def test_plan_model_deepseek_v32_gives_its_row_and_page_bytes(capsys):
    args = ["plan", "--model", "deepseek-v3.2", "--device-gb", "40", "--hicache-size", "200"]
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    kv, ik = d["model"]["KV"], d["model"]["INDEXER"]
    assert (kv["token_bytes"], ik["token_bytes"]) == (656, 132)
    assert (kv["page_bytes"], ik["page_bytes"]) == (41_984, 8_448)
    assert ik["page_layout"] == "values_then_scales"
    assert [p["bytes"] for p in kv["parts"]] == [512, 16, 128]
    pools = {(p["component"], p["tier"]): p for p in d["pools"]}
    # Device: 40 GB over 61 layers of both rows per 64-token page.
    per_page = 61 * (41_984 + 8_448)
    assert pools["KV", "device"]["pages"] == 40_000_000_000 // per_page
    assert pools["KV", "device"]["page_bytes"] == 61 * 41_984
    # Host: 200 GB split between the pools in proportion to their bytes (seed 000), the same
    # page count in both.
    host = pools["KV", "host"]["pages"]
    assert pools["INDEXER", "host"]["pages"] == host
    assert host == int(200e9 * 656 / (656 + 132)) // (61 * 41_984)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "656 B per token per layer" in out and "8,448 B per page per layer" in out
    assert main([*args, "--layers", "4"]) == 2, "a shape and a model together are refused"


def test_a_preset_stack_round_trips_its_packed_pages_exactly():
    import torch

    import sparsetier as st
    from sparsetier.presets import DEEPSEEK_V32

    s = st.build_sparse_stack(DEEPSEEK_V32.specs(pages=4), hicache_ratio=1.0, device_reserve=1)
    c = s.hicache
    toks = np.arange(1, 3 * 64 + 1)
    m = c.match_prefix(toks, alloc=True)
    g = torch.Generator().manual_seed(0)
    want = {}
    for comp, t in s.device_pools.items():
        idx = torch.as_tensor(np.asarray(m.pages), dtype=torch.long)
        data = torch.randint(0, 256, t[:, :, idx].shape, generator=g, dtype=torch.uint8)
        t[:, :, idx] = data.view(t.dtype)
        want[comp] = data
    c.insert(toks, m, unlock=m.device_node)
    c.flush()
    c.drain()
    c.evict_device(10)
    for t in s.device_pools.values():
        t.view(torch.uint8).fill_(0xEE)
    lb = c.load_back(c.match_prefix(toks).last_node)
    assert lb is not None
    c.flush()
    c.drain()
    m = c.match_prefix(toks)
    assert m.device_len == 3 * 64
    for comp, t in s.device_pools.items():
        got = t[:, :, torch.as_tensor(np.asarray(m.device_pages), dtype=torch.long)]
        assert torch.equal(got.view(torch.uint8), want[comp]), comp
    c.validate()


def test_an_existing_packed_device_pool_keeps_its_row_format():
    import torch

    import sparsetier as st
    from sparsetier.presets import DEEPSEEK_V32

    kv, ik = DEEPSEEK_V32.specs(pages=4)
    pools = [
        st.DevicePool("KV", torch.zeros(kv.shape(), dtype=torch.uint8), kv),
        st.DevicePool("INDEXER", torch.zeros(ik.shape(), dtype=torch.uint8), ik),
    ]
    s = st.build_sparse_stack(pools, hicache_ratio=1.0)
    host_ik = next(p for p in s.plan.pools if p.component == "INDEXER" and p.tier == "host")
    assert host_ik.spec.page_layout == "values_then_scales"
    assert host_ik.spec.token_pieces == ik.token_pieces
    with pytest.raises(st.ConfigError) as e:
        st.build_sparse_stack([st.DevicePool("KV", pools[1].tensor, ik)])
    assert e.value.field == "pools[0].spec"
    with pytest.raises(st.ConfigError) as e:  # the tensor must fit the spec
        st.build_sparse_stack([st.DevicePool("KV", torch.zeros(8, dtype=torch.uint8), kv)])
    assert e.value.field.startswith("pools[0].tensor")


def test_bench_prefix_compares_token_containers(capsys):
    args = ["bench", "prefix", "--containers", "--page-size", "16", "--serve-reqs", "20"]
    assert main([*args, "--num-seqs", "20", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    for kind in ("q", "numpy", "uint32", "list"):
        assert f"\n{kind} " in out


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_bench_vllm_runs_both_managers_on_one_stream(policy, tmp_path, capsys):
    out = tmp_path / "v.json"
    args = ["bench", "vllm", "--requests", "24", "--prompt-tokens", "2048", "--prefixes", "3"]
    args += ["--prefix-blocks", "80", "--kv-groups", "2", "--policy", policy, "--json", str(out)]
    assert main(args) == 0
    assert "median paired ratio" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["keys_per_request"] == 2 * 2048 // 16
    assert r["evictions"] > 0, "the pool is smaller than the stream"
    assert r["hit_keys_per_request"] > 0, "shared prefixes hit"
    assert r["paired"] == 24 - 4 and r["ratio_median"] > 0


def test_bench_tiered_pairs_a_tiered_run_with_a_resident_one(tmp_path, capsys):
    out = tmp_path / "tiered.json"
    args = ["bench", "tiered", "--pairs", "2", "--requests", "4", "--concurrent", "4",
            "--steps", "6", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    assert "median paired ratio" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["device_slots"] < r["peak_objects"] <= r["resident_slots"]
    assert [row["warmup"] for row in r["rows"]] == [True, False, False]
    # The order alternates from pair to pair.
    assert [row["tiered_first"] for row in r["rows"]] == [True, False, True]
    for row in r["rows"]:
        # With the prefills' seconds: decode tokens over prefill and decode seconds, each side.
        t_s = row["tokens"] / row["tiered_tokens_per_s"] + row["tiered_prefill_s"]
        r_s = row["tokens"] / row["resident_tokens_per_s"] + row["resident_prefill_s"]
        assert row["tiered_prefill_s"] > 0 and row["resident_prefill_s"] > 0
        assert row["whole_ratio"] == pytest.approx(r_s / t_s)
        # Both sides decoded the same tokens; the ratio is the tiered rate over the resident.
        assert row["tokens"] == row["resident_tokens"] > 0
        ratio = row["tiered_tokens_per_s"] / row["resident_tokens_per_s"]
        assert row["ratio"] == pytest.approx(ratio)
    timed = sorted(row["ratio"] for row in r["rows"][1:])
    assert r["median_ratio"] == pytest.approx((timed[0] + timed[1]) / 2)


def test_bench_tiered_fails_when_the_tiered_outputs_differ(monkeypatch):
    from sparsetier.tools import bench_tiered

    real = bench_tiered._run
    calls = []

    def run(cfg, model, work, slots, *a, **kw):
        rt, out, *rest = real(cfg, model, work, slots, *a, **kw)
        calls.append(slots)
        if len(calls) == 1:  # the first (tiered) run: one token off
            rid = min(out)
            out[rid] = out[rid] + 1
        return (rt, out, *rest)

    monkeypatch.setattr(bench_tiered, "_run", run)
    cfg = bench_tiered.TieredBenchConfig(pairs=1, requests=4, concurrent=4, steps=6)
    with pytest.raises(RuntimeError, match="pair 0: the tiered run's outputs differ"):
        bench_tiered.run(cfg)
    # The first run of the pair was the tiered one: fewer device slots than the resident.
    assert len(calls) == 2 and calls[0] < calls[1]


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--budget", "1.5"], "budget"),
        (["--pairs", "0"], "pairs"),
        (["--steps", "1"], "steps"),  # a turn of no decode step: nothing to compare
        (["--context-min", "8"], "context_min"),
        (["--graphs"], "graphs"),  # only with --device cuda --resolve device
        (["--graphs", "--device", "cuda", "--resolve", "host"], None),
    ],
)
def test_bench_tiered_refuses_bad_flags(flags, field, capsys):
    import torch

    if field is None:  # graphs with a host resolver: refused where a GPU is present too
        field = "device" if not torch.cuda.is_available() else "graphs"
    assert main(["bench", "tiered", *flags]) == 2
    assert field in capsys.readouterr().err


def test_bench_tiered_refuses_a_context_range_upside_down(capsys):
    assert main(["bench", "tiered", "--context-min", "2048", "--context-max", "1024"]) == 2
    err = capsys.readouterr().err
    assert "context_max" in err and "2048" in err
