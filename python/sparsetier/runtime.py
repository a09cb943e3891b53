"""Moved to ``sparsetier.tools.runtime`` (the decode runtime and its tiny model are tools over the
library, not part of it). This name stays for one release."""

import warnings

from sparsetier.tools.runtime import *  # noqa: F403
from sparsetier.tools.runtime import __all__  # noqa: F401

warnings.warn(
    "sparsetier.runtime moved to sparsetier.tools.runtime; the old name goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
