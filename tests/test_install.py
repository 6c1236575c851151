"""A user's install: ``pip install .`` (pip's build isolation on, so no torch at build time) into a fresh venv,
then ``peakflat-check`` reports the native extension, compiled on first use from the sources the install carries.

One test, about two minutes on two cores (most of it the compile). The fresh venv reuses this interpreter's
installed packages (torch, megatron-core) through a .pth file rather than downloading them again; pip's isolated
build environment fetches setuptools from the package index, as it does for any user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ["megatron_peakflat", "csrc", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE",
           "CHANGELOG.md"]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} -> {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="needs a C++ compiler")
def test_pip_install_in_a_fresh_venv_builds_the_extension_on_first_use(tmp_path):
    src = tmp_path / "src"  # a copy: pip builds in its source folder, and the checkout's prebuilt _C must not ride along
    src.mkdir()
    for name in SHIPPED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "_csrc"))
        elif path.exists():
            shutil.copy2(path, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_outer_packages.pth").write_text("\n".join(sorted(ours)) + "\n")  # torch and megatron-core, no download
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PEAKFLAT_", "PYTHONPATH"))}
    env.update(PEAKFLAT_EXT_CACHE=str(tmp_path / "cache"), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    _run([python, "-m", "pip", "install", "--disable-pip-version-check", "-q", str(src)], tmp_path, env, 900)
    where = _run([python, "-c", "import megatron_peakflat as m, os; print(m.__file__); "
                  "print(sorted(os.listdir(os.path.join(os.path.dirname(m.__file__), '_csrc'))))"], tmp_path, env, 300)
    package_file, csrc = where.stdout.splitlines()
    assert Path(package_file).is_relative_to(venv)  # the installed copy, not the checkout
    assert "bindings.cpp" in csrc and "host_pool.h" in csrc
    assert not list(Path(package_file).parent.glob("_C*.so"))  # nothing compiled at install time (no torch there)
    first = _run([venv / "bin" / "peakflat-check"], tmp_path, env, 1200)
    ext = [line for line in first.stdout.splitlines() if line.startswith("extension")]
    assert ext and "megatron_peakflat._C built on first use: C++ parts yes" in ext[0], first.stdout
    assert str(tmp_path / "cache") in first.stdout
    again = _run([python, "-m", "megatron_peakflat.check"], tmp_path, env, 300)
    assert "loaded from the build cache" in again.stdout, again.stdout
    plan = subprocess.run([venv / "bin" / "peakflat-plan", "--preset", "gpt-oss-20b", "--seq-len", "64K", "--gpus", "8",
                           "--hbm-gib", "80", "--host-gib", "2048"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert plan.returncode == 0 and plan.stdout.startswith("peakflat plan: gpt-oss-20b"), plan.stderr[-2000:]


# ---- the metadata, without installing ------------------------------------------------------------------------

def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once_and_read_by_the_build():
    import megatron_peakflat

    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "megatron_peakflat.__version__"}
    assert "version=" not in (ROOT / "setup.py").read_text()
    assert f"## [{megatron_peakflat.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_setup_py_holds_only_the_extension_build(monkeypatch):
    import runpy

    import setuptools

    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PEAKFLAT_BUILD_EXT", "0")
    runpy.run_path(str(ROOT / "setup.py"))
    assert set(captured) == {"ext_modules", "cmdclass"} and captured["ext_modules"] == []
    assert "build_py" in captured["cmdclass"]  # the one that ships csrc/ as megatron_peakflat/_csrc


def test_metadata_names_the_license_extras_and_console_scripts():
    import importlib

    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert project["requires-python"] == ">=3.12" and project["readme"] == "README.md"
    assert {"plot", "test", "te"} <= set(project["optional-dependencies"])
    assert "matplotlib" in project["optional-dependencies"]["plot"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert set(project["scripts"]) == {"peakflat-plan", "peakflat-check"}
    for target in project["scripts"].values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))
    assert "torch" not in " ".join(_pyproject()["build-system"]["requires"])  # build isolation needs no torch


def test_the_requirements_include_what_megatron_imports_undeclared():
    """megatron-core's checkpoint writer (megatron.core.dist_checkpointing.strategies.filesystem_async)
    imports psutil without declaring it: ``pip install .`` then ``python -m megatron_peakflat.pretrain --save ...``
    failed at the first save. The package declares it (pyproject.toml holds the metadata; setup.py none)."""
    from packaging.requirements import Requirement

    deps = {Requirement(d).name for d in _pyproject()["project"]["dependencies"]}
    assert "psutil" in deps
    assert "install_requires" not in (ROOT / "setup.py").read_text()
