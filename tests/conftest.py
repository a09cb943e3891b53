import os

import pytest
from hypothesis import settings

# CI runs the full profile; SPARSETIER_HYPOTHESIS=dev shortens local iteration, and
# SPARSETIER_HYPOTHESIS=deep is for a long bug hunt by hand (ten times CI's examples, runs
# twice as long).
settings.register_profile("ci", max_examples=200, stateful_step_count=50, deadline=None)
settings.register_profile("dev", max_examples=30, stateful_step_count=20, deadline=None)
settings.register_profile("deep", max_examples=2000, stateful_step_count=100, deadline=None)
settings.load_profile(os.environ.get("SPARSETIER_HYPOTHESIS", "ci"))


@pytest.fixture
def master():
    """A real mooncake_master on free localhost ports, stopped afterwards (skips, saying why,
    where it cannot run)."""
    from l3_support import mooncake_skip_reason

    from sparsetier.l3 import MooncakeMaster

    why = mooncake_skip_reason()
    if why:
        pytest.skip(why)
    m = MooncakeMaster()
    yield m
    m.stop()
