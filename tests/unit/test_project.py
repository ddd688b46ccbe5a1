"""Project-level promises: the README's commands, CI, and a light import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(60)


def _readme_commands() -> list[str]:
    with open(f"{REPO_ROOT}/README.md") as f:
        text = f.read()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if not line.startswith("#")]


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
    commands = _readme_commands()
    assert len(commands) == 2
    assert "examples/" in commands[0] and commands[1].endswith("bash tests/run_all.sh")
    with open(f"{REPO_ROOT}/.ci/run") as f:
        ci_lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert commands[1] in ci_lines
    # The script runs the whole suite (two workers), then the compat ends; any failure (pytest's 5, no test, too) is its exit code.
    with open(f"{REPO_ROOT}/tests/run_all.sh") as f:
        script = f.read()
    assert "set -euo pipefail" in script and ".venv/bin/python -m pytest -n 2 --dist loadfile || suite=$?" in script
    assert 'exit "$suite"' in script and script.rstrip().endswith("bash tests/compat/run_other_ends.sh test")


def test_importing_the_package_and_wire_is_light():
    code = ("import sys, pathways_torch, pathways_torch.wire, pathways_torch.errors; "
            "heavy = [m for m in ('torch', 'torch_xla', 'jax', 'torchax', 'controller', 'executor') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_public_names_resolve():
    import pathways_torch as pw

    for name in pw.__all__:
        assert getattr(pw, name) is not None
    assert issubclass(pw.RemoteError, pw.PathwaysError)
    assert issubclass(pw.CaptureError, pw.PathwaysError)
    assert issubclass(pw.ExecutorLostError, pw.PathwaysError)


def test_torch_is_a_range_and_python_3_12_is_allowed():
    """Installing the project must not move a user's torch to one release (issue 13)."""
    import re
    import tomllib

    with open(f"{REPO_ROOT}/pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    torch_spec = next(d for d in project["dependencies"] if re.match(r"torch\b(?!-)", d))
    assert "==" not in torch_spec and ">=2.9" in torch_spec, torch_spec
    assert any(d.startswith("torchax") for d in project["dependencies"])           # the default XLA route
    assert any(d.startswith("torch-xla==2.9.0") for d in project["optional-dependencies"]["torch-xla"])
    assert "<3.13" in project["requires-python"] and ">=3.11" in project["requires-python"]
