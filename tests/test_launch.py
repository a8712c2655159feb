"""``python launch.py`` (``tau2_rl/run/launch.py``): accelerate launch's flags, with one line where accelerate
would print a traceback. The process-level checks (a node that never joins, SIGTERM waiting for the checkpoint)
are slow tests in tests/test_sharded.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tau2_rl.run import launch

ROOT = Path(__file__).resolve().parents[1]


def test_the_trainers_exit_status_comes_back_without_a_launcher_traceback(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('error: one line', file=sys.stderr)\nsys.exit(3)\n")
    done = subprocess.run([sys.executable, "launch.py", "--config_file", "accelerate_configs/cpu.yaml", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 3
    assert done.stderr.strip().splitlines()[-1] == "error: one line"  # not repeated, no CalledProcessError after it
    assert "Traceback" not in done.stderr


def test_a_deepspeed_config_without_deepspeed_is_one_line_naming_the_pin(monkeypatch, capsys) -> None:
    import accelerate.commands.launch as accelerate_launch

    from tau2_rl.run import dependencies

    monkeypatch.setattr(accelerate_launch, "is_deepspeed_available", lambda: False)
    monkeypatch.setattr(dependencies, "is_installed", lambda module: False)  # as on a machine without it
    with pytest.raises(SystemExit) as info:
        launch.main(["--config_file", "accelerate_configs/zero3.yaml", "train_grpo.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("launch.py: error: --config_file accelerate_configs/zero3.yaml needs DeepSpeed, which is not "
                   "installed: pip install -r requirements-gpu.txt (deepspeed==0.19.8)")  # fmt: skip


def test_a_rendezvous_timeout_is_one_line_saying_what_to_do() -> None:
    from types import SimpleNamespace

    args = SimpleNamespace(num_machines=2, main_process_ip="10.0.0.1", main_process_port=29500)
    line = launch.rendezvous_line("Timed out after 20 seconds waiting for clients. 1/2 clients joined.", args)
    assert line == (
        "launch.py: error: the launch expected 2 nodes (2 rendezvous clients) at 10.0.0.1:29500, but 1 joined within "
        "the rendezvous timeout (20 s); start the same command on every node with its own --machine_rank, check that "
        "each can reach --main_process_ip:--main_process_port, or raise the timeout with --rdzv_conf "
        "timeout=<seconds>"
    )
    assert launch.rendezvous_line("Connection closed by peer", args) is None
