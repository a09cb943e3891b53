"""The shipped stub `_core.pyi` agrees with the built extension (mypy's stubtest)."""

import subprocess
import sys
from pathlib import Path


def test_stub_matches_module():
    r = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "sparsetier._core", "--concise"],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).parent,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_py_typed_is_shipped():
    import sparsetier

    assert (Path(sparsetier.__file__).parent / "py.typed").exists()
    assert (Path(sparsetier.__file__).parent / "_core.pyi").exists()
