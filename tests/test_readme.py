"""The code examples of the README and of docs/guide.md run as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("doc", ["README.md", "docs/guide.md"])
def test_python_blocks_run(doc):
    path = ROOT / doc
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    assert blocks, f"{doc} has no python example"
    for block in blocks:
        exec(compile(block, str(path), "exec"), {})


def test_the_readme_stays_short_and_in_order():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    # What it is, the two commands, install, an example, which API when, links.
    order = ["make demo", "## Install", "## Example", "## Which API", "## Docs"]
    at = [text.index(s) for s in order]
    assert at == sorted(at), order
    assert "../shared" not in text
