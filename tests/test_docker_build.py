"""The images built for real: both targets of docker/Dockerfile, on a local Debian base made by
debootstrap (docker/build-local.sh), then the cpu image's default sweep run as its user
(docker/run-local.sh) and its JSON, CSV and PNG read back; the gpu image's `gpucoll info`
says plainly that there is no driver where there is none.

Builds take many minutes, so these tests run only when asked for by name:

    sudo .venv/bin/python -m pytest -m image tests/test_docker_build.py

They skip, saying why, without root, podman, buildah or debootstrap.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TAG = "localhost/gpucoll-bench"
BUILD_S = 3600  # a first build downloads a Debian base, NumPy, matplotlib, CuPy and NCCL
RUN_S = 900

pytestmark = [pytest.mark.image, pytest.mark.timeout(BUILD_S + 2 * RUN_S)]


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root: debootstrap, and podman/buildah with chroot isolation"
    for tool in ("podman", "buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install podman buildah debootstrap)"
    return None


@pytest.fixture(scope="module")
def images() -> str:
    """Both images, built (again: podman reuses its cached layers) by the documented script."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([str(ROOT / "docker" / "build-local.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=BUILD_S,
                          env={**os.environ, "TARGETS": "cpu gpu", "TAG": TAG})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return TAG


def _run(image: str, results: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    results.chmod(0o777)  # the image's user (uid 1000) writes there
    return subprocess.run([str(ROOT / "docker" / "run-local.sh"), image, str(results), *args],
                          capture_output=True, text=True, timeout=RUN_S)


def test_the_cpu_images_default_sweep_writes_checked_json_csv_and_a_plot(images, tmp_path):
    proc = _run(f"{images}:cpu", tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "# Out of bounds values : 0 OK" in proc.stdout
    files = {ext: tmp_path / f"gpucoll-bench.{ext}" for ext in ("json", "csv", "png")}
    for path in files.values():
        assert path.stat().st_uid == 1000, f"{path.name} not written by the image's user"

    doc = json.loads(files["json"].read_text())
    (run,) = doc["runs"]
    assert (run["library"], run["backend"], run["ranks"]) == ("gpucoll", "ring", 2)
    ops = {d["op"] for d in run["results"]}
    assert ops == {"all_reduce", "all_gather", "broadcast"}
    sizes = 25  # 8 B .. 128 MiB by factor 2
    assert len(run["results"]) == 3 * sizes
    cells = [d[k] for d in run["results"] for k in ("out_of_place", "in_place") if d[k]]
    assert all(c["nwrong"] == 0 and c["loops"] >= 1 and c["time_median"] > 0 for c in cells)

    rows = list(csv.DictReader(files["csv"].open()))
    assert len(rows) == len(cells) and {r["op"] for r in rows} == ops
    png = files["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_the_gpu_image_says_there_is_no_driver_where_there_is_none(images, tmp_path):
    proc = _run(f"{images}:gpu", tmp_path, "info")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver: info reports it instead")
    assert "auto backend" in proc.stdout and "ring" in proc.stdout
    assert "CUDA" in proc.stdout and "driver" in proc.stdout.lower()
