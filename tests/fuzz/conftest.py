"""Settings of the property-based tier (Hypothesis): bounded in time for CI, reproducible.

Every run draws the same examples (``derandomize``), writes no example database, and stops each
test after ``MOE_EPLB_FUZZ_EXAMPLES`` examples (default 100; the whole tier takes about 10 s on
two cores). For a longer hunt: ``MOE_EPLB_FUZZ_EXAMPLES=5000 MOE_EPLB_FUZZ_RANDOM=1 pytest tests/fuzz``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "moe-eplb",
    max_examples=int(os.environ.get("MOE_EPLB_FUZZ_EXAMPLES", "100")),
    deadline=None,  # time is bounded by the example count; a slow CI core must not make it flaky
    derandomize=not os.environ.get("MOE_EPLB_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("moe-eplb")
