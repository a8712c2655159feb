"""The launchers in scripts/ (vLLM servers) and the GPU smoke check's CPU dry run; fast, offline, loopback only."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from scripts import _launch, serve_policy_vllm, serve_user_llm
from scripts._launch import LaunchError

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "Qwen2.5-72B-Instruct-AWQ"
    model.mkdir()
    (model / "config.json").write_text("{}", encoding="utf-8")
    return model


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _launch.importlib.util.find_spec
    monkeypatch.setattr(_launch.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name))


@pytest.fixture
def with_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _launch.importlib.util.find_spec
    monkeypatch.setattr(
        _launch.importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name)
    )


# ----------------------------------------------------------------------------------------------- pre-flight checks


@pytest.mark.parametrize("module", [serve_user_llm, serve_policy_vllm])
def test_missing_model_dir_is_a_clear_error(module, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(LaunchError, match=rf"--model {missing}: no such directory.*HF_HUB_OFFLINE"):
        module.main(["--model", str(missing), "--port", str(free_port())])
    assert module is not None and module.__name__.startswith("scripts.")
    # through the console entry: one line on stderr, exit code 2, nothing on stdout
    assert _launch.run_launcher(module.main, ["--model", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: --model") and "no such directory" in err


def test_model_dir_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="no config.json"):
        serve_user_llm.main(["--model", str(tmp_path), "--port", str(free_port())])


@pytest.mark.parametrize("module", [serve_user_llm, serve_policy_vllm])
def test_busy_port_is_a_clear_error(module, model_dir: Path, busy_port: int, with_vllm: None) -> None:
    with pytest.raises(LaunchError, match=rf"port {busy_port} on 127.0.0.1 is already in use.*--port"):
        module.main(["--model", str(model_dir), "--port", str(busy_port)])


@pytest.mark.parametrize("module", [serve_user_llm, serve_policy_vllm])
def test_missing_vllm_names_requirements_gpu(module, model_dir: Path, no_vllm: None) -> None:
    with pytest.raises(LaunchError, match=r"vLLM is not installed.*pip install -r requirements-gpu.txt"):
        module.main(["--model", str(model_dir), "--port", str(free_port())])


def test_a_free_port_passes_the_check() -> None:
    _launch.check_port_free(free_port(), "127.0.0.1")
    with pytest.raises(LaunchError, match="not a valid TCP port"):
        _launch.check_port_free(70000)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--gpu-ids", "1,x"], "--gpu-ids"),
        (["--gpu-ids", "1,1"], "distinct"),
        (["--gpu-ids", "1", "--tensor-parallel-size", "2"], "needs that many GPUs"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    ],
)
def test_bad_sizes_and_gpu_ids_fail_before_anything_starts(argv: list[str], needle: str, model_dir: Path) -> None:
    with pytest.raises(LaunchError, match=needle):
        serve_user_llm.main(["--model", str(model_dir), *argv, "--dry-run"])


# ------------------------------------------------------------------------------------------------------- dry runs


def test_user_llm_dry_run_prints_the_exact_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "/models/Qwen2.5-72B-Instruct-AWQ", "--gpu-ids", "1", "--port", "8001"]
    assert serve_user_llm.main([*argv, "--max-model-len", "32768", "--dry-run", "--", "--enforce-eager"]) == 0
    out = capsys.readouterr().out
    expected = (
        f"{OFFLINE} CUDA_VISIBLE_DEVICES=1 {sys.executable} -m vllm.entrypoints.openai.api_server "
        "--model /models/Qwen2.5-72B-Instruct-AWQ --served-model-name Qwen2.5-72B-Instruct-AWQ --host 127.0.0.1 "
        "--port 8001 --tensor-parallel-size 1 --gpu-memory-utilization 0.9 --dtype auto --enable-prefix-caching "
        "--generation-config vllm --max-model-len 32768 --enforce-eager\n"
    )
    assert out == expected


def test_policy_dry_run_prints_the_exact_trl_vllm_serve_command(capsys: pytest.CaptureFixture[str]) -> None:
    """The server trl vllm-serve would start for these flags, run through vLLM's api_server module."""
    from trl.scripts.vllm_serve import build_command as trl_build_command
    from trl.scripts.vllm_serve import make_parser as trl_make_parser

    argv = ["--model", "/models/Qwen2.5-7B-Instruct", "--gpu-ids", "6,7", "--tensor-parallel-size", "2"]
    assert serve_policy_vllm.main([*argv, "--port", "8000", "--host", "0.0.0.0", "--dry-run", "--", "--x", "1"]) == 0
    out = capsys.readouterr().out
    trl_flags = [
        "--model", "/models/Qwen2.5-7B-Instruct", "--host", "0.0.0.0", "--port", "8000", "--tensor_parallel_size",
        "2", "--data_parallel_size", "1", "--gpu_memory_utilization", "0.9", "--dtype", "auto",
        "--enable_prefix_caching", "true", "--max_model_len", "16384",
    ]  # fmt: skip
    (script_args,) = trl_make_parser().parse_args_into_dataclasses(trl_flags)
    trl_command = trl_build_command(script_args, ["--x", "1"])
    assert trl_command[:5] == [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        "/models/Qwen2.5-7B-Instruct",
    ]
    expected = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/Qwen2.5-7B-Instruct"]
    assert out.startswith(f"{OFFLINE} CUDA_VISIBLE_DEVICES=6,7 VLLM_SERVER_DEV_MODE=1 ")
    assert out.split(" VLLM_SERVER_DEV_MODE=1 ", 1)[1] == shlex.join(expected + trl_command[5:]) + "\n"
    assert "--weight-transfer-config" in trl_command and trl_command[-2:] == ["--x", "1"]


def test_policy_tool_calls_serves_an_agent(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--tool-calls: TRL's server plus native tool calls (hermes), the project's chat template (TRL's qwen2_5.jinja,
    the tiny model's byte for byte) and request-only sampling defaults; the served name is the directory's."""
    from tau2_rl.data.tiny_model import qwen2_5_chat_template

    assert serve_policy_vllm.main(["--model", "/models/step-000300", "--tool-calls", "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out)
    template = command[command.index("--chat-template") + 1]
    assert Path(template).read_text(encoding="utf-8") == qwen2_5_chat_template()
    tail = command[command.index("--served-model-name") :]
    assert tail == ["--served-model-name", "step-000300", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    "--chat-template", template, "--generation-config", "vllm"]  # fmt: skip
    assert "--weight-transfer-config" in command  # still trl vllm-serve's server
    assert serve_policy_vllm.main(["--model", "/m", "--tool-calls", "--served-model-name", "p", "--dry-run"]) == 0
    assert "--served-model-name p " in capsys.readouterr().out
    with pytest.raises(serve_policy_vllm.LaunchError, match="--chat-template"):
        serve_policy_vllm.main(["--model", "/m", "--tool-calls", "--chat-template", str(tmp_path / "x.jinja")])
    with pytest.raises(serve_policy_vllm.LaunchError, match="before --"):
        serve_policy_vllm.main(["--model", "/m", "--tool-calls", "--dry-run", "--", "--tool-call-parser", "x"])


def test_dry_run_as_a_file_and_as_a_module(tmp_path: Path) -> None:
    """Both ways of running a launcher work from the repository root, without vLLM or a GPU."""
    for prefix in (["scripts/serve_user_llm.py"], ["-m", "scripts.serve_user_llm"]):
        done = subprocess.run(
            [sys.executable, *prefix, "--model", "/models/m", "--dry-run"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "vllm.entrypoints.openai.api_server --model /models/m --served-model-name m" in done.stdout
    done = subprocess.run(
        [sys.executable, "scripts/serve_policy_vllm.py", "--model", str(tmp_path / "missing")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no such directory" in done.stderr and done.stdout == ""


def test_the_trl_vllm_serve_flags_exist() -> None:
    """Every flag the policy launcher gives `trl vllm-serve` is one it accepts (checked against TRL's parser)."""
    from trl.scripts.vllm_serve import make_parser

    args = serve_policy_vllm.make_parser().parse_args(["--model", "/m"])
    flags = serve_policy_vllm.trl_vllm_serve_arguments(args)
    (parsed,) = make_parser().parse_args_into_dataclasses(flags)
    assert parsed.model == "/m" and parsed.port == 8000 and parsed.host == "127.0.0.1"


# --------------------------------------------------------------------------------------------------- health wait


class _Health(BaseHTTPRequestHandler):
    ready_at = 0.0

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        ok = self.path == "/health" and time.monotonic() >= self.server.ready_at  # type: ignore[attr-defined]
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def health_server() -> Iterator[tuple[ThreadingHTTPServer, float]]:
    delay = 0.6
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    server.daemon_threads = True
    server.ready_at = time.monotonic() + delay  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, delay
    server.shutdown()
    server.server_close()


def test_wait_healthy_polls_until_the_server_turns_healthy(health_server) -> None:
    server, delay = health_server
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    waited = _launch.wait_healthy(url, timeout=10, interval=0.1)
    assert delay - 0.2 <= waited < 5


def test_wait_healthy_times_out_with_a_clear_error(health_server, tmp_path: Path) -> None:
    server, _ = health_server
    server.ready_at = time.monotonic() + 60  # type: ignore[attr-defined]
    log = tmp_path / "server.log"
    log.write_text("loading weights\nstill loading\n", encoding="utf-8")
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    with pytest.raises(LaunchError, match=r"(?s)did not become healthy within 0.5 s.*still loading"):
        _launch.wait_healthy(url, timeout=0.5, interval=0.1, log_path=log)


def test_a_child_that_exits_early_is_a_clear_error(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with open(log, "wb") as handle:
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('CUDA out of memory', flush=True); sys.exit(3)"],
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)exited with code 3 before .* became healthy.*CUDA out of memory"):
        _launch.wait_healthy(f"http://127.0.0.1:{free_port()}/health", child, timeout=60, interval=0.1, log_path=log)
    assert time.monotonic() - start < 10  # fails fast, not at the timeout


FAKE_SERVER = textwrap.dedent(
    """
    import sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, delay, lifetime = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    time.sleep(delay)
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
    server = HTTPServer(("127.0.0.1", port), H)
    server.timeout = 0.1
    print("serving", flush=True)
    end = time.monotonic() + lifetime
    while time.monotonic() < end:
        server.handle_request()
    """
)


def test_serve_detached_prints_the_base_url_once_healthy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    pid_file = tmp_path / "server.pid"
    command = [sys.executable, "-c", FAKE_SERVER, str(port), "0.5", "60"]
    code = _launch.serve(
        command,
        {"HF_HUB_OFFLINE": "1"},
        port=port,
        base_url=f"http://127.0.0.1:{port}/v1",
        log_file=tmp_path / "logs" / "server.log",
        health_timeout=30,
        interval=0.1,
        detach=True,
        pid_file=pid_file,
    )
    pid = int(pid_file.read_text())
    try:
        assert code == 0
        out, err = capsys.readouterr()
        assert out == f"http://127.0.0.1:{port}/v1\n"  # stdout holds only the URL
        assert "healthy after" in err and f"kill -- -{pid}" in err
        assert "serving" in (tmp_path / "logs" / "server.log").read_text()
        with pytest.raises(LaunchError, match="already in use"):
            _launch.check_port_free(port)
    finally:
        os.killpg(pid, signal.SIGTERM)


def test_serve_in_the_foreground_returns_the_server_exit_code(tmp_path: Path, capsys) -> None:
    port = free_port()
    command = [sys.executable, "-c", FAKE_SERVER, str(port), "0.2", "1.0"]
    code = _launch.serve(
        command, {}, port=port, base_url="URL", log_file=tmp_path / "s.log", health_timeout=30, interval=0.1
    )
    assert code == 0
    out, err = capsys.readouterr()
    assert out == "URL\n" and "exited with code 0" in err


def test_serve_stops_a_server_that_never_gets_healthy(tmp_path: Path) -> None:
    port = free_port()
    # A shell, not a Python child: under load a Python interpreter can take longer than the health timeout to print
    # its first line, and the error must quote the server's log.
    command = ["sh", "-c", "echo stuck; exec sleep 600"]
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)did not become healthy.*stuck"):
        _launch.serve(
            command, {}, port=port, base_url="URL", log_file=tmp_path / "s.log", health_timeout=2, interval=0.1
        )
    assert time.monotonic() - start < 20


# ------------------------------------------------------------------------------------------------ GPU smoke check

SMOKE = ROOT / "scripts" / "gpu_smoke.sh"


def smoke(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SMOKE), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_gpu_smoke_script_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(SMOKE)], capture_output=True).returncode == 0
    assert os.access(SMOKE, os.X_OK)


def test_gpu_smoke_dry_run_prints_every_command_and_the_table_header() -> None:
    done = smoke("--dry-run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    commands = [line for line in lines if line and not line.startswith(("#", "check", "---", "(dry run"))]
    # tiny model, GRPO per variant, collect, SFT, evaluation; served user: server, evaluation, GRPO; trl vllm-serve:
    # server, completion
    assert len(commands) == 1 + 5 + 1 + 1 + 1 + 3 + 2
    for variant in ("vanilla", "turn_discount", "prm_lite", "lata", "joint"):
        assert any(
            "train_grpo.py --config recipes/ablation/grpo_gpu_smoke.yaml" in c and f"--variant {variant} " in c
            for c in commands
        )
    assert any("train_sft.py --config recipes/ablation/sft_gpu_smoke.yaml" in c for c in commands)
    assert any("evaluate.py --config recipes/ablation/eval_gpu_smoke.yaml" in c for c in commands)
    assert any("accelerate_configs/single_gpu.yaml" in c for c in commands)
    header = next(line for line in lines if line.startswith("check"))
    assert [cell.strip() for cell in header.split("|")] == ["check", "result", "seconds", "step time (s)",
                                                            "peak GPU (MiB)"]  # fmt: skip
    assert lines[-1] == "(dry run: nothing was run)"
    # the environment variable does the same; --variants narrows the GRPO checks
    same = smoke(env={"GPU_SMOKE_DRY_RUN": "1"})
    assert same.returncode == 0 and same.stdout == done.stdout
    narrow = smoke("--dry-run", "--variants", "lata joint", "--gpu", "3")
    assert narrow.stdout.count("train_grpo.py") == 2 + 1 and "CUDA_VISIBLE_DEVICES=3" in narrow.stdout
    assert narrow.stdout.count("single_gpu.yaml --gpu_ids 3 train_") == 4  # 2 x GRPO, SFT, GRPO with the LLM user
    assert "--model gpu-smoke-joint --steps 1,2" in narrow.stdout  # the last variant's two checkpoints


def test_gpu_smoke_recipes_are_what_the_check_promises() -> None:
    import yaml

    grpo = yaml.safe_load((ROOT / "recipes/ablation/grpo_gpu_smoke.yaml").read_text())
    assert grpo["max_steps"] == 2 and grpo["bf16"] is True and grpo["use_vllm"] is True
    assert grpo["vllm_mode"] == "colocate" and grpo["vllm_enable_sleep_mode"] is True
    sft = yaml.safe_load((ROOT / "recipes/ablation/sft_gpu_smoke.yaml").read_text())
    assert sft["max_steps"] == 5 and sft["bf16"] is True
    evaluation = yaml.safe_load((ROOT / "recipes/ablation/eval_gpu_smoke.yaml").read_text())
    assert evaluation["backend"] == "vllm"


def test_gpu_smoke_commands_parse_with_the_real_entry_points() -> None:
    """Every recipe and flag the smoke check passes is accepted by its script (CPU stand-ins for the GPU flags)."""
    import evaluate
    import train_grpo
    import train_sft

    lines = smoke("--dry-run").stdout.splitlines()
    cpu = ["--use_cpu", "true", "--bf16", "false"]
    for line in lines:
        words = line.split()
        if "train_grpo.py" in words:
            argv = words[words.index("train_grpo.py") + 1 :]
            script_args, training_args, model_args = train_grpo.make_parser().parse_args_and_config(
                [*argv, *cpu, "--use_vllm", "false"]
            )
            assert training_args.max_steps == 2 and script_args.hub_dir == "outputs/gpu-smoke/hub"
            assert training_args.save_steps == 1
        elif "train_sft.py" in words:
            argv = words[words.index("train_sft.py") + 1 :]
            script_args, training_args, model_args = train_sft.make_parser().parse_args_and_config([*argv, *cpu])
            assert training_args.max_steps == 5 and script_args.dataset_path == "outputs/gpu-smoke/trajectories"
        elif "evaluate.py" in words:
            (args,) = evaluate.make_parser().parse_args_and_config(words[words.index("evaluate.py") + 1 :])
            assert args.tasks == "0,2,5"
            assert (args.backend, args.steps) == ("vllm", "1,2") or (args.backend, args.user_simulator) == (
                "transformers",
                "llm",
            )


def test_gpu_smoke_rejects_bad_input_and_needs_a_gpu_outside_dry_run() -> None:
    bad = smoke("--variants", "bogus", "--dry-run")
    assert bad.returncode == 2 and "unknown variant 'bogus'" in bad.stderr
    assert smoke("--frobnicate").returncode == 2
    if shutil.which("nvidia-smi") is None:
        real = smoke()
        assert real.returncode == 2 and "needs a GPU" in real.stderr
