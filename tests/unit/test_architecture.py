"""The architecture is checked, not hoped for: import contracts and the cycle check catch a breach.

Each test copies the package into a temporary folder, adds one forbidden import, and runs the
same checks CI runs (``lint-imports`` with the project's contracts, ``scripts/check_import_cycles.py``)
on the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    """A copy of edge_rtgi (sources only) and the project's contracts under ``tmp_path``."""
    shutil.copytree(
        ROOT / "edge_rtgi", tmp_path / "edge_rtgi", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def lint_imports(folder: Path) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(
            f"{LINT_IMPORTS} is missing: scripts/setup.sh installs import-linter with the test extras"
        )
    env = {**os.environ, "PYTHONPATH": str(folder)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(folder / "pyproject.toml")],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def add_import(module: Path, line: str) -> None:
    text = module.read_text()
    anchor = "from __future__ import annotations\n"
    assert anchor in text, module
    module.write_text(text.replace(anchor, anchor + "\n" + line + "\n", 1))


def test_the_contracts_hold_on_the_tree():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("llm/engine.py", "import edge_rtgi.server.app", "Layers"),  # the engine knows no server
        ("llm/scheduler.py", "import torch", "torch-free"),  # the scheduler runs without torch
        ("asr/streaming.py", "from edge_rtgi.llm import engine", "Layers"),  # speech and LLM are siblings
        (
            "device.py",
            "from edge_rtgi.llm import cpu_ops",
            "Layers",
        ),  # the ground floor imports nothing above
    ],
)
def test_a_forbidden_import_breaks_a_contract(package_copy, module, line, contract):
    add_import(package_copy / "edge_rtgi" / module, line)
    result = lint_imports(package_copy)
    assert result.returncode != 0, result.stdout
    broken = [row for row in result.stdout.splitlines() if row.endswith("BROKEN")]
    assert broken and any(contract in row for row in result.stdout.splitlines()), result.stdout


def test_the_tree_has_no_import_cycles():
    cycles = load_script("check_import_cycles")
    assert cycles.find_cycles(cycles.import_graph(ROOT / "edge_rtgi")) == []


def test_the_cycle_check_finds_a_lazy_cycle(package_copy):
    # An import inside a function is still a cycle in the design, even though Python can load it.
    module = package_copy / "edge_rtgi" / "llm" / "rope.py"
    module.write_text(
        module.read_text() + "\n\ndef _late():\n    from edge_rtgi.llm import cpu_ops  # noqa: F401\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "check_import_cycles.py"),
            "--root",
            str(package_copy / "edge_rtgi"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "edge_rtgi.llm.cpu_ops <-> edge_rtgi.llm.rope" in result.stdout


def test_type_checking_imports_do_not_count(package_copy):
    module = package_copy / "edge_rtgi" / "llm" / "rope.py"
    add_import(
        module, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from edge_rtgi.llm import cpu_ops"
    )
    cycles = load_script("check_import_cycles")
    assert cycles.find_cycles(cycles.import_graph(package_copy / "edge_rtgi")) == []
