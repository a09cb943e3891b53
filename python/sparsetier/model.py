"""Moved to ``sparsetier.tools.model`` (the decode runtime and its tiny model are tools over the
library, not part of it). This name stays for one release."""

import warnings

from sparsetier.tools.model import *  # noqa: F403
from sparsetier.tools.model import __all__  # noqa: F401

warnings.warn(
    "sparsetier.model moved to sparsetier.tools.model; the old name goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
