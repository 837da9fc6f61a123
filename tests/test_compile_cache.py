"""The compile cache (``cute_kda.ops._cache``, ``cute_kda.ops._disk_cache``) and the fake tensors the
launchers compile from.

CPU tier: fake descriptions give the kernels the DLPack path compiled (PTX byte-identical in the
generic address space; in global memory, the same instructions less the ``cvta.to.global``
conversions); the disk cache's hit, miss, key and fingerprint separation, corruption (never loaded,
rebuilt), the opt-out, an unusable folder, a held lock, a build holding back only its own key's
threads, and two processes compiling one key at once.
Real DSL compiles of the small tile prefix kernel stand in for any kernel.

GPU tier: the launchers' fake-compiled K1 and K2 give the results of kernels compiled from the
device tensors, bit for bit; a second process loads every variant from disk and answers the same.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from cute_kda.dsl import cute, cutlass
from cute_kda.ops import _cache, _disk_cache
from cute_kda.variants import PrepareVariant
from cute_kda.ops._cache import TVM_FFI_OPTION, CompileCache, dlpack_tensor, to_cute_tensor
from cute_kda.workspace import WorkspaceSpec, allocate_workspace, tiles_per_head

ROOT = Path(__file__).resolve().parents[1]
D = 128


def _ptx(kernel, *args) -> str:
    with tempfile.TemporaryDirectory() as dump:
        return cute.compile(kernel, *args, options=f"--keep-ptx --dump-dir={dump} {TVM_FFI_OPTION}").__ptx__


def _opcodes(ptx: str) -> Counter:
    return Counter(line.split()[0] for line in ptx.splitlines()
                   if line.startswith("\t") and line.strip() and not line.strip().startswith(("//", ".", "$", "{", "}", ")")))


def _generic(tensor, assumed_align=16, **kw):
    from cutlass.cute.typing import AddressSpace

    return to_cute_tensor(tensor, assumed_align, memspace=AddressSpace.generic, **kw)


def _k1(tensor):
    from cute_kda.kernels.fwd_prepare import prepare_kernel
    from cute_kda.ops.prepare import launch_arguments

    heads, tokens = 2, 40
    q = torch.zeros(1, tokens, heads, D, dtype=torch.bfloat16)
    ws = allocate_workspace(WorkspaceSpec(heads=heads, tiles=tiles_per_head(tokens, 2, True)), "cpu")
    args = launch_arguments(q, q, q, q[..., 0].contiguous(), torch.zeros(heads), torch.zeros(heads, D), ws, D ** -0.5,
                        -5.0, tokens, torch.tensor([0, 17, tokens]), torch.tensor([0, 2, 4], dtype=torch.int32),
                        cute.runtime.make_fake_stream(), tensor=tensor)
    return prepare_kernel(varlen=True), args


def _k2(tensor):
    from cute_kda.kernels.fwd_recurrence import FwdRecurrence
    from cute_kda.ops import recurrence as k2

    v = torch.zeros(1, 40, 2, D, dtype=torch.bfloat16)
    ws = allocate_workspace(WorkspaceSpec(heads=2, tiles=4), "cpu")
    state = torch.zeros(2, 2, D, D)
    args = k2.launch_arguments(v, ws, torch.zeros_like(v), cu_seqlens=torch.tensor([0, 17, 40]),
                               tile_base=torch.tensor([0, 2, 4], dtype=torch.int32), initial_state=state,
                               final_state=state, tensor=tensor)
    kernel = FwdRecurrence(vsplit=2, initial_state=cutlass.Float32, final_state=cutlass.Float32, varlen=True)
    return kernel, (*args, cute.runtime.make_fake_stream())


def _tile_prefix(tensor):
    from cute_kda.kernels.tile_prefix import TilePrefixKernel

    return TilePrefixKernel(), (tensor(torch.tensor([0, 5, 40]), 8), tensor(torch.zeros(3, dtype=torch.int32), 4),
                                cute.runtime.make_fake_stream())


KERNELS = {"K1_varlen": _k1, "K2_vs2_fp32_varlen": _k2, "tile_prefix": _tile_prefix}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_fake_tensors_describe_what_dlpack_described(name):
    """In the generic address space the fake description compiles to the DLPack path's PTX, byte for
    byte; in global memory (what the launchers use, so the entry takes CUDA tensors) only the
    generic → global address conversions go."""
    def ptx(tensor):
        kernel, args = KERNELS[name](tensor)
        return _ptx(kernel, *args)

    reference = ptx(dlpack_tensor)
    assert ptx(_generic) == reference
    launched = ptx(to_cute_tensor)
    dropped = _opcodes(reference) - _opcodes(launched)
    assert set(dropped) <= {"cvta.to.global.u64"} and not _opcodes(launched) - _opcodes(reference)


def test_fake_tensor_keeps_dtype_rank_and_contiguous_mode():
    fake = to_cute_tensor(torch.empty(3, 5, 7, dtype=torch.bfloat16, device="meta"), 16)
    assert fake.element_type is cutlass.BFloat16
    assert len(fake.shape) == 3 and fake.stride[2] == 1 and fake.dynamic_shapes_mask == (1, 1, 1)
    assert fake.dynamic_strides_mask == (1, 1, 0)
    inner_first = to_cute_tensor(torch.empty(3, 5, dtype=torch.float32, device="meta"), 4, leading_dim=0)
    assert inner_first.stride[0] == 1
    assert to_cute_tensor(None) is None
    with pytest.raises(TypeError, match="no CuTe DSL element type"):
        to_cute_tensor(torch.empty(2, dtype=torch.complex64, device="meta"))


def test_k1_compiles_from_meta_tensors_without_a_device(monkeypatch, tmp_path):
    """``compile_variant`` allocates nothing: it works on a machine with no CUDA at all."""
    from cute_kda.ops import prepare as k1

    monkeypatch.setenv("CUTE_KDA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(k1, "_PREPARE", CompileCache("fwd_prepare"))
    monkeypatch.setattr(k1, "_TILE_PREFIX", CompileCache("tile_prefix"))
    k1.compile_variant(PrepareVariant(True, True, False), torch.device("cuda", 0))
    assert k1._PREPARE.stats == {"compiled": 1} and k1._TILE_PREFIX.stats == {"compiled": 1}
    assert len(list(tmp_path.rglob("*.o"))) == 2


@pytest.mark.parametrize("kind", ["recurrence", "bwd_scan", "bwd_grads"])
def test_scans_and_kernel_b_compile_from_meta_tensors_without_a_device(monkeypatch, tmp_path, kind):
    """K2, Kernel A and Kernel B compile ahead of time from ``meta`` tensors too (no device memory, no CUDA)."""
    import importlib

    from cute_kda.layouts.bwd_grads import DEFAULT_WARPS
    from cute_kda.variants import GradsVariant, RecurrenceVariant, ScanVariant

    module = importlib.import_module(f"cute_kda.ops.{kind}")
    variant = {"recurrence": RecurrenceVariant(2, torch.float32, torch.bfloat16, True, True),
               "bwd_scan": ScanVariant(4, torch.float32, None, True),
               "bwd_grads": GradsVariant(True, True, True, "softplus", torch.bfloat16, True, True, DEFAULT_WARPS)}[kind]
    monkeypatch.setenv("CUTE_KDA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(module, "_CACHE", CompileCache(kind))
    module.compile_variant(variant, torch.device("cuda", 0))
    assert module._CACHE.stats == {"compiled": 1} and (variant, 0) in module._CACHE


# ---------------------------------------------------------------------------------------------
# the disk cache, with the tile prefix kernel as the compiled object


def _compile_tile_prefix():
    kernel, args = _tile_prefix(to_cute_tensor)
    return _cache.compile_for_launch(kernel, *args)


def _refuses_cpu_tensors(compiled) -> bool:
    """A compiled tile prefix entry checks its arguments: CPU tensors are refused by device type."""
    with pytest.raises(ValueError, match="device_type=cuda"):
        compiled(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int32), None)
    return True


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_KDA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUTE_KDA_DISK_CACHE", raising=False)
    return tmp_path


def _entry(cache_dir, name="test_prefix", key=(0,)):
    return _disk_cache.entry_for(cache_dir, name, key)


def test_miss_then_hit_in_a_fresh_cache(cache_dir, caplog):
    first = CompileCache("test_prefix")
    with caplog.at_level(logging.INFO, logger="cute_kda"):
        compiled = first.get((0,), _compile_tile_prefix)
    assert first.stats == {"compiled": 1} and first.get((0,), _compile_tile_prefix) is compiled
    (notice,) = [r for r in caplog.records if r.name == "cute_kda.compile"]  # the compile, on the library's logger
    assert notice.levelno == logging.INFO and notice.getMessage().startswith("compiled test_prefix (0,) in ")
    entry = _entry(cache_dir)
    record = json.loads(entry.record.read_text())
    assert record["key"] == "test_prefix:(0,)" and record["bytes"] == entry.obj.stat().st_size
    assert 0 < record["compile_s"] < 600  # the compile's seconds, for summing what a fresh run spent compiling

    second = CompileCache("test_prefix")  # as a new process would see it: nothing in memory

    def must_not_build():
        raise AssertionError("a verified entry must be loaded, not rebuilt")

    loaded = second.get((0,), must_not_build)
    assert second.stats == {"loaded": 1} and _refuses_cpu_tensors(loaded)


def test_fresh_and_loaded_compiles_launch_through_the_same_entry(cache_dir):
    """A fresh compile hands the launchers its TVM-FFI function, not the DSL object whose ``__call__``
    adds a keyword wrapper per launch: the callable the disk cache loads in a later process."""
    import tvm_ffi

    fresh = CompileCache("test_prefix").get((0,), _compile_tile_prefix)
    loaded = CompileCache("test_prefix").get((0,), _compile_tile_prefix)
    assert type(fresh) is type(loaded) is tvm_ffi.Function
    assert _refuses_cpu_tensors(fresh)
    plain = _compile_tile_prefix()
    assert _cache.launch_entry(plain) is not plain and isinstance(_cache.launch_entry(plain), tvm_ffi.Function)


def test_keys_names_and_fingerprints_do_not_share_entries(cache_dir, monkeypatch):
    cache = CompileCache("test_prefix")
    cache.get((0,), _compile_tile_prefix)
    cache.get((1,), _compile_tile_prefix)
    CompileCache("other_name").get((0,), _compile_tile_prefix)
    assert len(list(cache_dir.rglob("*.o"))) == 3
    monkeypatch.setattr(_disk_cache, "source_fingerprint", lambda: "f" * 64)  # a kernel source changed
    changed = CompileCache("test_prefix")
    changed.get((0,), _compile_tile_prefix)
    assert changed.stats == {"compiled": 1} and (cache_dir / ("f" * 20)).is_dir()


def test_fingerprint_follows_the_kernel_sources(monkeypatch, tmp_path):
    names = {path.relative_to(_disk_cache.PACKAGE).as_posix() for path in _disk_cache._source_files()}
    assert {"kernels/fwd_recurrence.py", "kernels/fwd_prepare/base.py", "kernels/tile_prefix.py",
            "layouts/smem.py", "ops/prepare.py", "numerics.py"} <= names
    assert "api.py" not in names and "validation.py" not in names  # host-side checks do not recompile
    before = _disk_cache.source_fingerprint()
    fake_package = tmp_path / "pkg"
    (fake_package / "kernels").mkdir(parents=True)
    (fake_package / "kernels" / "k.py").write_text("x = 1\n")
    monkeypatch.setattr(_disk_cache, "PACKAGE", fake_package)
    _disk_cache.source_fingerprint.cache_clear()
    try:
        one = _disk_cache.source_fingerprint()
        (fake_package / "kernels" / "k.py").write_text("x = 2\n")
        _disk_cache.source_fingerprint.cache_clear()
        assert _disk_cache.source_fingerprint() != one != before
    finally:
        _disk_cache.source_fingerprint.cache_clear()


def _corrupt_truncated(entry):
    entry.obj.write_bytes(entry.obj.read_bytes()[:1000])


def _corrupt_flipped_byte(entry):
    data = bytearray(entry.obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.obj.write_bytes(bytes(data))


def _corrupt_record(entry):
    entry.record.write_text("{not json")


def _record_for_other_key(entry):
    record = json.loads(entry.record.read_text())
    record["key"] = "test_prefix:(99,)"
    entry.record.write_text(json.dumps(record))


def _record_missing(entry):
    entry.record.unlink()


def _object_missing(entry):
    entry.obj.unlink()


CORRUPTIONS = [_corrupt_truncated, _corrupt_flipped_byte, _corrupt_record, _record_for_other_key, _record_missing,
               _object_missing]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_entry_is_never_loaded_and_is_rebuilt(cache_dir, monkeypatch, corrupt):
    CompileCache("test_prefix").get((0,), _compile_tile_prefix)
    entry = _entry(cache_dir)
    corrupt(entry)
    real_load_module = cute.runtime.load_module

    def guarded_load_module(path, **kw):
        assert _disk_cache._verified_bytes(entry) is not None, "the loader was handed an unverified file"
        return real_load_module(path, **kw)

    monkeypatch.setattr(cute.runtime, "load_module", guarded_load_module)
    rebuilt = CompileCache("test_prefix")
    compiled = rebuilt.get((0,), _compile_tile_prefix)
    assert rebuilt.stats == {"compiled": 1} and _refuses_cpu_tensors(compiled)
    again = CompileCache("test_prefix")
    again.get((0,), _compile_tile_prefix)
    assert again.stats == {"loaded": 1}  # the rebuilt entry is whole


def test_a_verified_entry_the_loader_refuses_is_rebuilt(cache_dir, monkeypatch):
    CompileCache("test_prefix").get((0,), _compile_tile_prefix)

    def broken_loader(path, **kw):
        raise RuntimeError("JIT link failed")

    monkeypatch.setattr(cute.runtime, "load_module", broken_loader)
    cache = CompileCache("test_prefix")
    cache.get((0,), _compile_tile_prefix)
    assert cache.stats == {"compiled": 1}


def test_disk_cache_can_be_turned_off(cache_dir, monkeypatch):
    monkeypatch.setenv("CUTE_KDA_DISK_CACHE", "0")
    cache = CompileCache("test_prefix")
    cache.get((0,), _compile_tile_prefix)
    assert cache.stats == {"compiled": 1} and not any(cache_dir.iterdir())


def test_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("CUTE_KDA_CACHE_DIR", raising=False)
    monkeypatch.delenv("CUTE_KDA_DISK_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _disk_cache.cache_root() == tmp_path / ".cache" / "cute_kda"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _disk_cache.cache_root() == tmp_path / "xdg" / "cute_kda"


def test_unusable_folder_compiles_anyway(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("CUTE_KDA_CACHE_DIR", str(blocker / "cache"))  # a folder under a file
    cache = CompileCache("test_prefix")
    with pytest.warns(RuntimeWarning, match="not usable"):
        compiled = cache.get((0,), _compile_tile_prefix)
    assert cache.stats == {"compiled": 1} and _refuses_cpu_tensors(compiled)


def test_a_held_lock_times_out_into_a_compile_without_the_disk(cache_dir, monkeypatch):
    entry = _entry(cache_dir)
    entry.lock.parent.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(_disk_cache, "LOCK_TIMEOUT_S", 0.2)
    with open(entry.lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # flock locks belong to the open file: this one is another holder
        cache = CompileCache("test_prefix")
        with pytest.warns(RuntimeWarning, match="timed out"):
            cache.get((0,), _compile_tile_prefix)
    assert cache.stats == {"compiled": 1} and not entry.obj.exists()


def test_a_build_holds_back_only_its_own_key(monkeypatch):
    """While one thread builds a key (or waits on another process's lock of it), another key of the same cache is
    had at once, and a second thread wanting the key being built waits for that build instead of repeating it."""
    monkeypatch.setenv("CUTE_KDA_DISK_CACHE", "0")
    cache = CompileCache("test_threads")
    inside, release = threading.Event(), threading.Event()
    builds = Counter()

    def slow_build():
        builds["slow"] += 1
        inside.set()
        assert release.wait(timeout=30)
        return "slow"

    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, cache.get("slow", slow_build)))
               for i in range(2)]
    threads[0].start()
    assert inside.wait(timeout=30)
    threads[1].start()
    assert cache.get("other", lambda: "other") == "other"  # not held back by the build of "slow"
    release.set()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {0: "slow", 1: "slow"} and builds == {"slow": 1}
    assert cache.stats == {"compiled": 2}


WORKER = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    from cute_kda.ops._cache import CompileCache
    import test_compile_cache as t

    def slow_build():
        time.sleep(1.0)  # both processes are inside get() at once
        return t._compile_tile_prefix()

    open(sys.argv[1], "w").close()
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    cache = CompileCache("test_prefix")
    cache.get((0,), slow_build)
    print(json.dumps(dict(cache.stats)))
""")


def test_two_processes_compile_a_key_once(cache_dir, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    env = {**os.environ, "CUTE_KDA_CACHE_DIR": str(cache_dir)}
    go = tmp_path / "go"
    workers = [subprocess.Popen([sys.executable, str(script), str(tmp_path / f"ready{i}"), str(go)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert all(w.poll() is None for w in workers), [w.communicate() for w in workers]
    go.write_text("")
    results = []
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(results, key=str) == [{"compiled": 1}, {"loaded": 1}]
    assert len(list(cache_dir.rglob("*.o"))) == 1 and not list(cache_dir.rglob("*.tmp*"))


# ---------------------------------------------------------------------------------------------
# GPU tier


@pytest.mark.gpu
def test_fake_compiled_launchers_match_dlpack_compiled_kernels(device, monkeypatch):
    """K1 and K2 through the launchers (fake-tensor compiles, global address space) against the same
    kernels compiled from the device tensors themselves (DLPack, generic address space): bit for bit. The
    per-tile kernels on both sides: the two-tile prefill (``variants.PAIR_PREFILL``) is off."""
    monkeypatch.setattr("cute_kda.variants.PAIR_PREFILL", False)
    from test_api import make_inputs

    import cute_kda
    from cute_kda.kernels.fwd_prepare import prepare_kernel
    from cute_kda.kernels.fwd_recurrence import FwdRecurrence
    from cute_kda.ops import prepare as k1
    from cute_kda.ops import recurrence as k2
    from cute_kda.ops._cache import current_stream, launch_tensor

    inputs = make_inputs([300, 17, 64], 4, device)
    h0 = 0.1 * torch.randn(3, 4, D, D, device=device)
    o, state = cute_kda.kda_forward(**inputs, initial_state=h0, output_final_state=True, vsplit=2)

    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    cu = inputs["cu_seqlens"]
    tile_base = k1.tile_bases(cu)
    spec = WorkspaceSpec(heads=4, tiles=tiles_per_head(q.shape[1], 3, True))
    ws = allocate_workspace(spec, device)
    stream = current_stream(device)
    args = (q, k, g, beta, inputs["A_log"], inputs["dt_bias"], ws, D ** -0.5, -5.0, q.shape[1], cu, tile_base, stream)
    prepare = cute.compile(prepare_kernel(varlen=True), *k1.launch_arguments(*args, tensor=dlpack_tensor),
                           options=TVM_FFI_OPTION)
    prepare(*k1.launch_arguments(*args, tensor=launch_tensor))
    out, final = torch.empty_like(v), torch.empty_like(h0)
    tensors = dict(v=v, ws=ws, out=out, cu_seqlens=cu, tile_base=tile_base, initial_state=h0, final_state=final)
    kernel = FwdRecurrence(vsplit=2, initial_state=cutlass.Float32, final_state=cutlass.Float32, varlen=True)
    recurrence = cute.compile(kernel, *k2.launch_arguments(**tensors, tensor=dlpack_tensor), stream,
                              options=TVM_FFI_OPTION)
    recurrence(*k2.launch_arguments(**tensors), stream)
    torch.cuda.synchronize()
    assert torch.equal(o, out) and torch.equal(state, final)


WARM_PROCESS = textwrap.dedent("""
    import json, sys, time
    start = time.perf_counter()
    sys.path.insert(0, {root!r})
    import torch
    import cute_kda
    from cute_kda.ops import prepare, recurrence
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)
    q, k, v, g = (x(1, 100, 2, 128) for _ in range(4))
    beta = x(1, 100, 2)
    cu = torch.tensor([0, 37, 100], device="cuda")
    o, s = cute_kda.kda_forward(q, k, v, g, beta, A_log=torch.zeros(2, device="cuda"),
                                dt_bias=torch.zeros(2, 128, device="cuda"), cu_seqlens=cu, output_final_state=True)
    torch.cuda.synchronize()
    stats = {{c.name: dict(c.stats) for c in (prepare._PREPARE, prepare._TILE_PREFIX, recurrence._CACHE)}}
    print(json.dumps({{"seconds": time.perf_counter() - start, "stats": stats,
                      "o": o.float().sum().item(), "s": s.sum().item()}}))
""")


@pytest.mark.gpu
def test_second_process_loads_every_variant_from_disk(tmp_path):
    script = tmp_path / "first_call.py"
    script.write_text(WARM_PROCESS.format(root=str(ROOT)))
    env = {**os.environ, "CUTE_KDA_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    print(f"[compile cache] first call: cold process {cold['seconds']:.2f}s, warm process {warm['seconds']:.2f}s")
    assert all(s == {"compiled": 1} for s in cold["stats"].values()), cold
    assert all(s == {"loaded": 1} for s in warm["stats"].values()), warm
    assert (cold["o"], cold["s"]) == (warm["o"], warm["s"])
