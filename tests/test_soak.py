"""A short soak of the joined scheduler: memory flat once the host tier is full, latency
reported, data patterns and invariants checked (the long run is `sparsetier soak`, outside
CI)."""

import numpy as np
import pytest

from sparsetier.tools import soak
from sparsetier.tools.cli import main
from sparsetier.tools.soak import SoakConfig, run

_SOAK = """
import json, sys
from sparsetier.tools.soak import SoakConfig, run
cfg = SoakConfig(requests=4000, every=400, device_slots=3000, host_pages=1500,
                 indexer_pages=1200, prompts=300, faults=0.02)
print(json.dumps({"host_pages": cfg.host_pages, "layers": cfg.layers,
                  "reports": run(cfg, quiet=True, engine=sys.argv[1])}))
"""


@pytest.mark.parametrize("engine", soak.ENGINES)
def test_short_soak_keeps_memory_flat_after_warm_up(engine):
    # In a process of its own: its RSS is the soak's, not what earlier tests left behind
    # (their threads and caches grew the shared process's RSS mid-soak once).
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _SOAK, engine], capture_output=True, text=True,
                       timeout=600, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    cfg = SoakConfig(host_pages=out["host_pages"], layers=out["layers"])
    reports = out["reports"]
    assert len(reports) == 10
    # Objects are bounded by the host tier (every layer of every host page), whatever the
    # request count; RSS stays flat from the 40 % mark on.
    assert all(r["objects"] <= cfg.host_pages * cfg.layers for r in reports)
    assert reports[-1]["rss_mib"] - reports[3]["rss_mib"] < 8.0, reports
    assert reports[-1]["plan_p99_us"] > 0
    # Every selected page's rows and every admitted prefix's Indexer-K were compared.
    assert reports[-1]["rows_checked"] > reports[0]["rows_checked"] > 0
    assert reports[-1]["restores_failed"] + reports[-1]["failed_loads"] > 0, "faults ran"


def test_the_soak_catches_a_row_that_went_wrong(monkeypatch):
    # A planted bug: one K row in 500 writes with a flipped byte, as a torn copy or a slot
    # reused too early would leave it. The soak must fail on it, not count it as checked.
    real = soak._Patterns.write_kv
    n = {"calls": 0}

    def torn(self, slots, rows, toks, pos):
        real(self, slots, rows, toks, pos)
        n["calls"] += 1
        if n["calls"] % 500 == 0:  # K of the call's first row at the last layer
            self.kv[0, 0, slots[-1].flat[0], np.atleast_1d(rows)[0], 0, 0] ^= 0xFF

    monkeypatch.setattr(soak._Patterns, "write_kv", torn)
    cfg = SoakConfig(requests=2000, every=500, device_slots=3000, host_pages=1500,
                     indexer_pages=1200, prompts=100, faults=0.0)  # fmt: skip
    with pytest.raises(AssertionError, match="data pattern broken"):
        run(cfg, quiet=True)


def test_soak_command(tmp_path, capsys):
    j = tmp_path / "s.jsonl"
    assert main(["soak", "--requests", "200", "--every", "100", "--device-slots", "2000",
                 "--host-pages", "1000", "--indexer-pages", "800", "--prompts", "50",
                 "--json", str(j)]) == 0  # fmt: skip
    assert len(j.read_text().splitlines()) == 2
    assert "invariants checked" in capsys.readouterr().out
    assert main(["soak", "--requests", "0"]) == 2


def test_the_rust_soak_reports_as_it_goes_and_stops_on_request(tmp_path):
    seen = []

    def stop(rep):
        seen.append(rep["requests"])
        if len(seen) == 2:
            raise KeyboardInterrupt  # what Ctrl-C in the callback looks like

    cfg = SoakConfig(requests=100_000, every=100, device_slots=2000, host_pages=1000,
                     indexer_pages=800, prompts=50)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        run_soak_with(cfg, stop)
    assert len(seen) == 2 and 100 <= seen[0] < seen[1] < 1000


def run_soak_with(cfg, cb):
    from dataclasses import asdict

    from sparsetier.testing import run_soak

    return run_soak(**asdict(cfg), on_report=cb)


@pytest.mark.parametrize(
    "field, value",
    [("engine", "go"), ("faults", 1.5), ("page_size", 0), ("requests", 0)],
)
def test_bad_soak_settings_name_the_field(field, value):
    from sparsetier.errors import ConfigError

    cfg = SoakConfig(requests=10)
    kw = {"engine": value} if field == "engine" else {}
    if field != "engine":
        setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=field):
        run(cfg, quiet=True, **kw)


def test_the_rust_soak_refuses_sizes_it_cannot_hold():
    from dataclasses import asdict

    from sparsetier.errors import ConfigError
    from sparsetier.testing import run_soak

    with pytest.raises(ConfigError, match="layers"):
        run_soak(**{**asdict(SoakConfig()), "layers": 70_000})
