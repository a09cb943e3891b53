"""A short soak of the joined scheduler: memory flat once the host tier is full, latency
reported, invariants checked at the end (the long run is `sparsetier soak`, outside CI)."""

from sparsetier.cli import main
from sparsetier.soak import SoakConfig, run


def test_short_soak_keeps_memory_flat_after_warm_up():
    cfg = SoakConfig(requests=4000, every=400, device_slots=3000, host_pages=1500,
                     indexer_pages=1200, prompts=300, faults=0.02)  # fmt: skip
    reports = run(cfg, quiet=True)
    assert len(reports) == 10
    # Objects are bounded by the host tier (every layer of every host page), whatever the
    # request count; RSS stays flat from the 40 % mark on.
    assert all(r["objects"] <= cfg.host_pages * cfg.layers for r in reports)
    assert reports[-1]["rss_mib"] - reports[3]["rss_mib"] < 8.0, reports
    assert reports[-1]["plan_p99_us"] > 0


def test_soak_command(tmp_path, capsys):
    j = tmp_path / "s.jsonl"
    assert main(["soak", "--requests", "200", "--every", "100", "--device-slots", "2000",
                 "--host-pages", "1000", "--indexer-pages", "800", "--prompts", "50",
                 "--json", str(j)]) == 0  # fmt: skip
    assert len(j.read_text().splitlines()) == 2
    assert "invariants checked" in capsys.readouterr().out
    assert main(["soak", "--requests", "0"]) == 2
