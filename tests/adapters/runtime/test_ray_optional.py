"""Ray is optional: deo's run path on this machine never loads it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_local_run_path_never_imports_ray() -> None:
    code = (
        "import sys\n"
        "import adapters.cli, adapters.run, adapters.runtime.config_file\n"
        "import adapters.runtime.processes, adapters.runtime.runner\n"
        "from adapters.runtime.config_file import ExecutorSettings\n"
        "assert ExecutorSettings().kind == 'local'\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
