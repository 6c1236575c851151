"""The native extension megatron_peakflat._C and its loader: clear errors when it is missing, the
host pool's carving, and the host AdamW kernel's thread-count invariance and bf16 upload rounding."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_peakflat import _build, _ext
from megatron_peakflat.optimizer.streamer import NativeStreamer

EXT = _ext.load()
native = pytest.mark.skipif(EXT is None, reason=f"megatron_peakflat._C not built: {_ext.reason()}")
readelf = pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils) to read a library's links")
linux = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")


def _python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``code`` run by this interpreter in a fresh process (what it imports, how it ends, its own)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_require_names_the_feature_and_the_build_command(monkeypatch):
    monkeypatch.setattr(_ext, "_state", {"module": None, "reason": "megatron_peakflat._C is not built (test)"})
    with pytest.raises(_ext.ExtensionMissingError) as e:
        _ext.require("the host AdamW kernel")
    msg = str(e.value)
    assert "the host AdamW kernel" in msg and "compiled on first use" in msg and "--no-build-isolation" in msg
    assert _ext.load() is None  # cached: no second attempt


def test_importing_the_package_loads_no_extension():
    code = ("import sys, megatron_peakflat, megatron_peakflat.optimizer, megatron_peakflat._ext as e; "
            "print('megatron_peakflat._C' in sys.modules, repr(e.reason()))")
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "''"], out.stdout


@native
def test_load_finds_the_built_extension_before_anything_imported_torch():
    # The extension links against torch's shared libraries: loaded first, it was reported "not built".
    code = "import megatron_peakflat._ext as e; m = e.load(); print(m is not None, e.reason())"
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("True prebuilt"), out.stdout


def test_load_tries_once_and_caches_module_and_reason(monkeypatch):
    import importlib

    calls = []
    real = importlib.import_module

    def spy(name, *a, **k):
        calls.append(name)
        return real(name, *a, **k)

    monkeypatch.setattr(_ext, "_state", {})
    monkeypatch.setattr(_ext.importlib, "import_module", spy)
    first = _ext.load()
    assert _ext.load() is first and _ext.load() is first
    assert calls == ["megatron_peakflat._C"]
    assert _ext.reason().startswith("prebuilt" if first is not None else "megatron_peakflat._C is not built")


@native
def test_host_pool_carves_aligned_zeroed_tensors():
    pool = EXT.HostPool(1 << 20, False)
    a = pool.carve(1000, torch.float32)
    b = pool.carve(3, torch.bfloat16)
    c = pool.carve(10, torch.float32)
    assert a.numel() == 1000 and b.dtype == torch.bfloat16
    assert float(a.abs().sum()) == 0.0
    for t in (a, b, c):
        assert t.data_ptr() % 256 == 0
    assert c.data_ptr() >= b.data_ptr() + 6
    a.fill_(1.0)
    assert float(c.sum()) == 0.0  # carved ranges do not overlap
    assert not pool.pinned and pool.pin_error == ""  # no pinning asked
    asked = EXT.HostPool(4096, True)
    assert asked.pinned or asked.pin_error  # pinned, or it says why not (no CUDA build / no device)
    del pool
    a.add_(1.0)  # the carved tensor keeps the pool alive
    assert float(a.sum()) == 2000.0


@native
def test_host_pool_refuses_sizes_past_its_end_even_when_the_byte_count_overflows():
    # numel * element size past 2**63 wrapped around and carved a tensor far larger than the pool
    pool = EXT.HostPool(1 << 16, False)
    for numel in (1 << 20, 2**62 + 1000, 2**62, 2**61 + 1):
        with pytest.raises(RuntimeError, match="exceed"):
            pool.carve(numel, torch.float32)
    assert pool.used == 0
    assert pool.carve(0, torch.float32).numel() == 0
    with pytest.raises(RuntimeError, match="numel must be >= 0, got -1"):
        pool.carve(-1, torch.float32)
    with pytest.raises(RuntimeError, match="bytes must be positive, got -5$"):  # numbers vanished with two runtimes
        EXT.HostPool(-5, False)


@pytest.mark.parametrize("ext", [None, pytest.param("native", marks=native)])
def test_host_region_refuses_bad_sizes_before_the_pool_sees_them(ext):
    from megatron_peakflat.optimizer.host_memory import HostRegion

    region = HostRegion(1024, pin=False, ext=EXT if ext else None)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        region.carve(-4, torch.float32)
    with pytest.raises(MemoryError, match="bytes needed"):
        region.carve(2**62, torch.float32)
    assert region.carve(256, torch.float32).numel() == 256


@native
def test_host_pool_builds_while_other_threads_use_pybind_objects():
    # The GIL used to be released around pybind's own registration of the new pool: another thread creating
    # pybind objects meanwhile aborted the process ("Tried to deallocate unregistered instance!").
    code = """
import threading, torch, megatron_peakflat._C as C
stop = False
def churn():
    while not stop:
        fs = [torch.futures.Future() for _ in range(256)]
        del fs
t = threading.Thread(target=churn); t.start()
for _ in range(60):  # the old binding aborted within this, three times out of three
    ps = [C.HostPool(4096, False) for _ in range(64)]
    del ps
stop = True; t.join(); print("ok")
"""
    out = _python(code, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])


@native
def test_kernel_runs_the_ranges_of_threads_it_cannot_start_itself():
    # With the address space capped so that only one more 8 MiB thread stack fits, the kernel used to call
    # std::terminate (a std::thread vector destroyed while joinable); now this thread runs the other ranges.
    code = """
import resource, torch, megatron_peakflat._C as C
n = 1 << 20
g = torch.randn(n, generator=torch.Generator().manual_seed(0))
ref = [torch.zeros(n) for _ in range(3)]
C.adamw_step(*ref[:1], g, *ref[1:], None, 1e-3, 0.9, 0.999, 1e-8, 0.1, 1.0, 1)
got = [torch.zeros(n) for _ in range(3)]
vm = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (vm + (12 << 20), resource.RLIM_INFINITY))
C.adamw_step(*got[:1], g, *got[1:], None, 1e-3, 0.9, 0.999, 1e-8, 0.1, 1.0, 8)
print(all(torch.equal(a, b) for a, b in zip(ref, got)))
"""
    out = _python(code)
    assert out.returncode == 0 and out.stdout.strip() == "True", (out.returncode, out.stdout, out.stderr[-2000:])


@native
def test_kernel_is_invariant_to_thread_count_and_rounds_bf16_like_torch():
    g = torch.Generator().manual_seed(0)
    n = 3 * (1 << 16) + 5
    base = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01]
    grad = torch.randn(n, generator=g)
    outs = []
    for threads in (1, 2, 3):
        p, m, v = (t.clone() for t in base)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step in (1, 2, 3):
            EXT.adamw_step(p, grad, m, v, out, 1e-3, 0.9, 0.999, 1e-8, 0.01, float(step), threads)
        outs.append((p, m, v, out))
        assert torch.equal(out, p.bfloat16())
    for o in outs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(o, outs[0]))
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1.00390625, 1.01171875])
    p = special.clone()
    out = torch.empty(5, dtype=torch.bfloat16)
    EXT.adamw_step(p, torch.zeros(5), torch.zeros(5), torch.zeros(5), out, 0.0, 0.9, 0.999, 1e-8, 0.0, 1.0, 1)
    assert torch.isnan(out[0])  # torch's vector path writes 0xFFFF, c10::BFloat16 0x7FC0: both NaN
    assert torch.equal(out[1:].view(torch.int16), p[1:].bfloat16().view(torch.int16))  # inf, -0, ties to even


@native
def test_kernel_rejects_bad_arguments():
    p = torch.zeros(8)
    with pytest.raises(RuntimeError, match="grad has 4 elements"):
        EXT.adamw_step(p, torch.zeros(4), torch.zeros(8), torch.zeros(8), None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1)
    with pytest.raises(RuntimeError, match="float32"):
        EXT.adamw_step(p.double(), torch.zeros(8), torch.zeros(8), torch.zeros(8), None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1)


@native
def test_bucket_streamer_is_bound_exactly_in_cuda_builds():
    assert hasattr(EXT, "BucketStreamer") == bool(EXT.with_cuda)
    if EXT.with_cuda and not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device is visible"):
            NativeStreamer(EXT, 2, 0)


def _links(library: Path) -> tuple[list[str], set[str]]:
    """(the shared libraries ``library`` needs, the C++ runtime symbols it defines itself), read by readelf."""
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    syms = subprocess.run(["readelf", "--dyn-syms", "-W", str(library)], capture_output=True, text=True, check=True).stdout
    defined = {f[7] for f in (line.split() for line in syms.splitlines())
               if len(f) >= 8 and f[6] != "UND" and f[7] in ("__cxa_throw", "__gxx_personality_v0")}
    return [line.split()[-1].strip("[]") for line in needed.splitlines() if "(NEEDED)" in line], defined


@linux
def test_build_rules_name_the_cxx_runtime_torch_loaded():
    path = _build.cxx_runtime()
    assert path is not None and Path(path).name.startswith("libstdc++.so") and Path(path).exists()
    assert _build.cxx_runtime_link_args() == [path]
    assert _build.cxx_runtime("/nonexistent/maps") is None


@linux
@readelf
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_compiler_with_only_the_static_cxx_runtime_links_torchs_shared_one(tmp_path):
    # The H200 image's CXX (/opt/gcc/bin/g++) searches a folder holding libstdc++.a and no libstdc++.so first:
    # the extension then carried its own C++ runtime, and any exception it threw ended the process there
    # (SIGSEGV; here the numbers in its messages vanished). The same toolchain, in miniature:
    static = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not Path(static).is_file():
        pytest.skip("g++ has no static libstdc++.a to stand for such a compiler")
    (tmp_path / "only_static").mkdir()
    (tmp_path / "only_static" / "libstdc++.a").symlink_to(static)
    src = tmp_path / "throws.cpp"
    src.write_text('#include <stdexcept>\nextern "C" void peakflat_throws() { throw std::runtime_error("x"); }\n')

    def link(name: str, extra: list[str]) -> Path:
        out = tmp_path / name
        subprocess.run(["g++", f"-B{tmp_path / 'only_static'}/", "-shared", "-fPIC", str(src), *extra, "-o", str(out)],
                       check=True, capture_output=True)
        return out

    needed, defined = _links(link("plain.so", []))
    assert "libstdc++.so.6" not in needed and defined  # the failure reproduced: a runtime of its own
    needed, defined = _links(link("ruled.so", _build.cxx_runtime_link_args()))
    assert "libstdc++.so.6" in needed and not defined


@linux
def test_setup_and_the_jit_build_link_torchs_cxx_runtime(monkeypatch):
    import runpy

    import setuptools

    root = Path(__file__).resolve().parent.parent
    runtime = _build.cxx_runtime_link_args()
    assert runtime
    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.chdir(root)
    monkeypatch.setenv("PEAKFLAT_CUDA", "0")
    runpy.run_path(str(root / "setup.py"))
    (ext,) = captured["ext_modules"]
    assert all(arg in ext.extra_link_args for arg in runtime)

    assert all(arg in _ext._build_args(_ext.sources_dir(), False)["extra_ldflags"] for arg in runtime)


@native
@readelf
def test_the_built_extension_uses_the_shared_cxx_runtime():
    needed, defined = _links(Path(EXT.__file__))
    assert "libstdc++.so.6" in needed and not defined


# ---- the build on first use (JIT) and its cache ------------------------------------------------------------

def _no_prebuilt(monkeypatch) -> None:
    """load() as where no extension was built at install time (``pip install .`` with build isolation)."""
    real = _ext.importlib.import_module

    def import_module(name, *a, **k):
        if name == "megatron_peakflat._C":
            raise ImportError("No module named 'megatron_peakflat._C'")
        return real(name, *a, **k)

    monkeypatch.setattr(_ext, "_state", {})
    monkeypatch.setattr(_ext.importlib, "import_module", import_module)


def test_the_cache_is_keyed_by_torch_cuda_parts_and_source_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAKFLAT_EXT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    for f in _ext.sources_dir().iterdir():
        if f.is_file():
            (src / f.name).write_bytes(f.read_bytes())
    cpp_only = _ext.build_dir(src, False)
    assert cpp_only.parent == tmp_path / "cache" and cpp_only == _ext.build_dir(src, False)
    assert cpp_only.name.startswith(f"torch{torch.__version__}-cuda{torch.version.cuda or 'none'}-cpp-py")
    assert _ext.build_dir(src, True).name.split("-")[2] == "cpp+cuda"
    (src / "host_pool.h").write_text((src / "host_pool.h").read_text() + "\n// changed\n")
    changed = _ext.build_dir(src, False)
    assert changed != cpp_only and changed.name.rsplit("-", 1)[0] == cpp_only.name.rsplit("-", 1)[0]
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert _ext.build_dir(src, False).name.startswith("torch9.9.9-")


def test_a_missing_extension_is_built_once_into_the_cache_and_loaded_from_it(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setenv("PEAKFLAT_EXT_CACHE", str(tmp_path))
    monkeypatch.setenv("PEAKFLAT_CUDA", "0")
    calls = []

    def fake_load(**kw):  # stands for the compiler: writes the library where torch would
        calls.append(kw)
        library = Path(kw["build_directory"]) / f"{kw['name']}.so"
        library.write_bytes(b"")
        return type("M", (), {"__file__": str(library), "with_cuda": False})()

    loaded = []
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(_ext, "_import_library", lambda path: loaded.append(path) or "cached module")
    _no_prebuilt(monkeypatch)
    with caplog.at_level("INFO", logger="megatron_peakflat"):
        module = _ext.load()
    assert module is not None and _ext.source() == "jit" and len(calls) == 1
    folder = Path(calls[0]["build_directory"])
    assert folder.parent == tmp_path and (folder / "complete").is_file()
    assert calls[0]["sources"] and all(Path(s).parent == _ext.sources_dir() for s in calls[0]["sources"])
    assert "-ffp-contract=off" in calls[0]["extra_cflags"]
    assert [r.levelname for r in caplog.records if "megatron_peakflat._C" in r.getMessage()] == ["INFO", "INFO"]
    assert _ext.load() is module and len(calls) == 1  # once per process
    # the next process finds it in the cache: no compiler, no build
    _no_prebuilt(monkeypatch)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("compiled again"))
    monkeypatch.setattr(_ext.shutil, "which", lambda name, **kw: None)  # no compiler, no ninja
    assert _ext.load() == "cached module" and len(calls) == 1
    assert loaded == [folder / "megatron_peakflat_C.so"] and "loaded from the build cache" in _ext.reason()


def test_where_it_cannot_be_built_one_warning_says_what_falls_back_and_the_fix(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PEAKFLAT_EXT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    _no_prebuilt(monkeypatch)
    with caplog.at_level("INFO", logger="megatron_peakflat"):
        assert _ext.load() is None and _ext.load() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    (msg,) = warnings
    assert "no-such-compiler" in msg and "install g++" in msg  # why
    assert _ext.FALLBACKS in msg  # what falls back
    assert "pip install --no-build-isolation ." in msg and "PEAKFLAT_BUILD_EXT=0" in msg  # the fixes
    assert _ext.source() == "missing"


def test_a_failed_compile_is_one_warning_with_the_compilers_error(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    def failing_load(**kw):
        raise RuntimeError("Error building extension 'megatron_peakflat_C': [1/4] c++ ...\n"
                           "host_pool.cpp:3:10: fatal error: torch/extension.h: No such file or directory")

    monkeypatch.setenv("PEAKFLAT_EXT_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", failing_load)
    if shutil.which("c++") is None or _ext._find_ninja() is None:
        pytest.skip("needs c++ and ninja on PATH to reach the compile step")
    _no_prebuilt(monkeypatch)
    with caplog.at_level("INFO", logger="megatron_peakflat"):
        assert _ext.load() is None
    (msg,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "compiling megatron_peakflat._C failed: RuntimeError: Error building extension" in msg
    assert "torch/extension.h" in _ext.build_log()


def test_peakflat_build_ext_0_builds_nothing_and_does_not_warn(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setenv("PEAKFLAT_BUILD_EXT", "0")
    monkeypatch.setenv("PEAKFLAT_EXT_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("PEAKFLAT_BUILD_EXT=0 compiled"))
    _no_prebuilt(monkeypatch)
    with caplog.at_level("INFO", logger="megatron_peakflat"):
        assert _ext.load() is None
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert "PEAKFLAT_BUILD_EXT=0" in _ext.reason() and not list(tmp_path.iterdir())
