"""Ray is optional: deo's run path on this machine never loads it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_executor_table_is_checked_with_its_keys(tmp_path: Path) -> None:
    from adapters.runtime.config_file import load
    from core import ConfigError

    config = tmp_path / "deo.toml"
    config.write_text('[executor]\nkind = "ray"\naddress = "10.0.0.1:6379"\nnamespace = "rl"\n')
    executor = load(config).executor
    assert (executor.kind, executor.address, executor.namespace) == ("ray", "10.0.0.1:6379", "rl")
    assert load(tmp_path.joinpath("deo.toml")).log == tmp_path.resolve() / "deo.jsonl"
    for text, named in (
        ('[executor]\nkind = "slurm"\n', "executor.kind: 'slurm' is not one of 'local', 'ray'"),
        ('[executor]\nnamespace = ""\n', "executor.namespace: empty"),
        ("[executor]\nspawn_timeout_s = 0\n", "executor.spawn_timeout_s must be > 0"),
        ("[executor]\ncall_timeout_s = -1\n", "executor.call_timeout_s must be > 0"),
        ('[executor]\nadress = "x"\n', "executor.adress"),
    ):
        config.write_text(text)
        with pytest.raises(ConfigError) as refused:
            load(config)
        assert named in str(refused.value), text


def test_engine_pools_load_with_the_ray_executor_and_host_is_an_engines_placeholder(
    tmp_path: Path,
) -> None:
    from adapters.runtime.config_file import load
    from core import ConfigError
    from core.config import ENGINE_HOST

    config = tmp_path / "deo.toml"
    engine = (
        '[pools.gen]\nkind = "engine"\nengine = "vllm"\nports = [18000, 18003]\nmax_workers = 2\n'
        'argv = ["serve", "--host", "{host}", "--port", "{port}"]\n'
    )
    config.write_text('[executor]\nkind = "ray"\n\n' + engine)
    settings = load(config)
    (spec,) = settings.config.pools
    # Left for the executor, which knows the engine's machine.
    assert spec.render_argv(worker_id="gen-0", index=0, gpus=(), port=18000) == (
        "serve",
        "--host",
        ENGINE_HOST,
        "--port",
        "18000",
    )
    config.write_text('[pools.env]\nargv = ["env", "--host", "{host}"]\nmax_workers = 1\n')
    with pytest.raises(ConfigError, match=r"pools\.env\.argv: \{host\} in .* only given to engine"):
        load(config)
