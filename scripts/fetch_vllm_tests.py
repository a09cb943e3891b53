"""Fetch vLLM's own KV-offload tests from its released sdist (its wheel has no tests/).

    python scripts/fetch_vllm_tests.py 0.33.0 DEST

downloads ``vllm-<version>.tar.gz`` from PyPI's simple index, checks its sha256 against the
index's record, and
extracts ``tests/v1/kv_offload/`` (and the package markers above it) under ``DEST``. ``make
test`` runs it once per version; ``tests/test_vllm_manager.py`` runs those tests against
sparsetier's manager.
"""

from __future__ import annotations

import hashlib
import io
import re
import sys
import tarfile
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

KEEP = "tests/v1/kv_offload/"


def main() -> None:
    version, dest = sys.argv[1], Path(sys.argv[2])
    # The simple index (PEP 503): each file's link carries its sha256.
    page = "https://pypi.org/simple/vllm/"
    html = urllib.request.urlopen(page).read().decode()
    want = f"vllm-{version}.tar.gz"
    links = [h for h in re.findall(r'href="([^"]+)"', html) if want in h]
    if not links:
        sys.exit(f"no {want} on {page}")
    url, _, fragment = links[0].partition("#")
    url = urljoin(page, url)
    digest = fragment.removeprefix("sha256=")
    data = urllib.request.urlopen(url).read()
    if hashlib.sha256(data).hexdigest() != digest:
        sys.exit(f"{url}: sha256 does not match the index's record")
    root = f"vllm-{version}/"
    wanted = {root + "tests/__init__.py", root + "tests/v1/__init__.py"}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.isfile() and (m.name.startswith(root + KEEP) or m.name in wanted)
        ]
        for m in members:
            m.name = m.name[len(root) :]
        tar.extractall(dest, members=members, filter="data")
    for d in ("tests", "tests/v1"):
        (dest / d / "__init__.py").touch()
    print(f"{dest}: {len(members)} files of vllm {version}'s {KEEP}")


if __name__ == "__main__":
    main()
