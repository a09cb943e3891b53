import os

from hypothesis import settings

# CI runs the full profile; SPARSETIER_HYPOTHESIS=dev shortens local iteration.
settings.register_profile("ci", max_examples=200, stateful_step_count=50, deadline=None)
settings.register_profile("dev", max_examples=30, stateful_step_count=20, deadline=None)
settings.load_profile(os.environ.get("SPARSETIER_HYPOTHESIS", "ci"))
