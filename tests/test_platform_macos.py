"""macOS at run time, here on Linux: memory from `vm_stat` outputs recorded on real Macs
(tests/fixtures/platforms/SOURCES.md), and the paging advice's macOS path run through a fake libc and without the
calls macOS's Python lacks (posix_fadvise, preadv): prefetch still brings the bytes in, release invalidates."""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path

import pytest

from primaplug.memory import advice, darwin
from primaplug.memory.advice import F_RDAHEAD, MS_INVALIDATE, Advisor, Libc
from primaplug.memory.residency import PAGE, drop_file_cache, resident_bytes
from primaplug.memory.system import memory_view, thread_major_faults

FIXTURES = Path(__file__).parent / "fixtures" / "platforms" / "macos"
INTEL, APPLE = "wazuh-intel-vm_stat.txt", "mlx-profiler-apple-silicon-vm_stat.txt"
MiB, GiB = 1 << 20, 1 << 30


def _vm_stat(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- memory ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "page"), [(INTEL, 4096), (APPLE, 16384)])
def test_recorded_vm_stat_parses_and_adds_up(name: str, page: int) -> None:
    """xnu's accounting holds in both readings: the pageable queues (active, inactive, speculative) are exactly the
    file-backed plus the anonymous pages."""
    size, pages = darwin.parse_vm_stat(_vm_stat(name))
    assert size == page and pages["Translation faults"] > 0
    queues = pages["Pages active"] + pages["Pages inactive"] + pages["Pages speculative"]
    assert queues == pages["File-backed pages"] + pages["Anonymous pages"]


def test_an_intel_mac_at_rest() -> None:
    # hw.memsize CONSTRUCTED as 32 GiB: the pages it printed add up to 31.997 GiB
    view = darwin.darwin_view(_vm_stat(INTEL), 32 * GiB)
    assert view.source == "macos" and view.total_bytes == 32 * GiB
    assert view.available_bytes == (6127229 + 1080348 + 11820) * 4096  # free + file-backed + purgeable
    assert view.note == "free + file-backed + purgeable pages"


def test_an_apple_silicon_mac_that_compresses() -> None:
    """On the Mac that compresses and swaps, inactive pages are mostly other programs' anonymous memory: psutil's
    figure (inactive + free, its free counting speculative) and the profiler's older vm_stat sum (free + inactive +
    purgeable + speculative) count them; the node does not."""
    text = _vm_stat(APPLE)
    view = darwin.darwin_view(text, 32 * GiB)  # hw.memsize CONSTRUCTED: not in the recording
    _, p = darwin.parse_vm_stat(text)
    assert view.available_bytes == (26450 + 414135 + 138454) * 16384  # 8.8 GiB
    psutil_like = (p["Pages inactive"] + p["Pages free"] + p["Pages speculative"]) * 16384  # 13.4 GiB
    profiler_like = (p["Pages free"] + p["Pages inactive"] + p["Pages purgeable"] + p["Pages speculative"]) * 16384
    assert view.available_bytes < psutil_like < profiler_like
    assert psutil_like - view.available_bytes > 4 * GiB


def test_under_memory_pressure_only_free_pages_count() -> None:
    # the pressure levels are CONSTRUCTED inputs (xnu's dispatch values 1, 2, 4); the page counts are recorded
    text = _vm_stat(APPLE)
    assert darwin.darwin_view(text, 32 * GiB, darwin.PRESSURE_NORMAL).available_bytes == (26450 + 414135 + 138454) \
        * 16384
    for level in (darwin.PRESSURE_WARN, darwin.PRESSURE_CRITICAL):
        view = darwin.darwin_view(text, 32 * GiB, level)
        assert view.available_bytes == (26450 + 24144) * 16384 and f"level {level}" in view.note
    assert darwin.parse_pressure_level("2\n") == 2 and darwin.parse_pressure_level(None) is None
    assert darwin.parse_pressure_level("sysctl: unknown oid") is None


def test_odd_vm_stat_outputs() -> None:
    text = _vm_stat(INTEL)
    assert darwin.darwin_view(text, GiB).available_bytes == GiB  # CONSTRUCTED total: never more than there is
    # CONSTRUCTED from the recording: vm_stat before OS X 10.9 printed no file-backed count
    old = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("File-backed"))
    view = darwin.darwin_view(old, 32 * GiB)
    assert view.available_bytes == (6127229 + 430715 + 11820) * 4096 and "no file-backed" in view.note
    with pytest.raises(ValueError, match="page size"):
        darwin.parse_vm_stat("Pages free: 12.\n")


def test_the_live_reading_runs_vm_stat_and_sysctl(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    asked: list[list[str]] = []

    def run(argv: list[str]) -> str | None:
        asked.append(argv)
        return _vm_stat(APPLE) if argv == ["vm_stat"] else "1\n"

    view = darwin.read_darwin_view(32 * GiB, run)
    assert view is not None and view.available_bytes == (26450 + 414135 + 138454) * 16384
    assert asked == [["vm_stat"], ["sysctl", "-n", "kern.memorystatus_vm_pressure_level"]]
    assert darwin.read_darwin_view(GiB, lambda argv: None) is None
    # memory_view on "macos": here vm_stat does not exist, so psutil's figure, with a warning
    with caplog.at_level(logging.WARNING, logger="primaplug.memory.system"):
        assert memory_view("macos").source == "psutil"
    assert "vm_stat did not run" in caplog.text
    monkeypatch.setattr(darwin, "run_command", run)
    assert memory_view("macos").source == "macos"


def test_a_nodes_welcome_reports_the_memory_it_budgets(gemma_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node on a Mac (the recorded Apple silicon one) tells a head the memory its budget and its profile start from,
    free + file-backed + purgeable pages, not psutil's inactive + free."""
    import psutil

    from primaplug.head import NodeClient
    from primaplug.memory import system
    from tests.inproc_nodes import InprocNodes

    monkeypatch.setattr(system, "host_os", lambda: "macos")
    monkeypatch.setattr(darwin, "run_command", lambda argv: _vm_stat(APPLE) if argv == ["vm_stat"] else "1\n")
    with InprocNodes([gemma_path], 1) as nodes:
        transport = nodes.head_transport()
        client = NodeClient(transport, nodes.addresses[0])
        try:
            facts = client.hello().device
        finally:
            client.close()
            transport.close()
    total = psutil.virtual_memory().total  # hw.memsize on a Mac
    assert facts.mem_total_bytes == total
    assert facts.mem_available_bytes == min((26450 + 414135 + 138454) * 16384, total) == memory_view().available_bytes


# --- paging advice ---------------------------------------------------------------------------------------------------


class DarwinLibc(Libc):
    """macOS's calls as the Advisor makes them: mapping for real (this machine's mmap), msync and fcntl recorded
    (their macOS meaning cannot be had here), every call logged."""

    def __init__(self, msync_result: int = 0, can_map: bool = True) -> None:
        super().__init__()
        self.calls: list[tuple[object, ...]] = []
        self.msync_result, self.can_map = msync_result, can_map
        self.base: int | None = None

    def madvise(self, addr: int, length: int, advice: int) -> int:
        self.calls.append(("madvise", advice))
        return super().madvise(addr, length, advice)

    def mmap_shared(self, fd: int, length: int) -> int | None:
        self.base = super().mmap_shared(fd, length) if self.can_map else None
        self.calls.append(("mmap", length))
        return self.base

    def munmap(self, addr: int, length: int) -> int:
        self.calls.append(("munmap", addr, length))
        return super().munmap(addr, length)

    def msync(self, addr: int, length: int, flags: int) -> int:
        self.calls.append(("msync", addr, length, flags))
        return self.msync_result

    def fcntl(self, fd: int, cmd: int, arg: int) -> int:
        self.calls.append(("fcntl", cmd, arg))
        return 0

    def errno(self) -> int:
        return 5  # EIO, for the failing msync


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    with path.open("wb") as f:
        f.write(os.urandom(16 * MiB))
        f.flush()
        os.fsync(f.fileno())  # written back, so that it can leave the page cache
    return path


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident_bytes(path, [(0, path.stat().st_size)]) > MiB:
        pytest.skip("the file stayed in the page cache; cannot measure")


def _as_on_macos(monkeypatch: pytest.MonkeyPatch, preadv: bool) -> None:
    """macOS's Python has no posix_fadvise, and before macOS 11 no preadv."""
    monkeypatch.delattr(os, "posix_fadvise")
    monkeypatch.delattr(os, "POSIX_FADV_DONTNEED")
    if not preadv:
        monkeypatch.delattr(os, "preadv")


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="drops the file from the page cache to measure")
@pytest.mark.parametrize("preadv", [True, False])
def test_macos_prefetch_reads_and_release_invalidates(model_file: Path, monkeypatch: pytest.MonkeyPatch,
                                                      preadv: bool) -> None:
    _drop(model_file)
    _as_on_macos(monkeypatch, preadv)
    libc = DarwinLibc()
    advisor = Advisor(str(model_file), platform="darwin", libc=libc)
    assert "unified buffer cache" in advisor.mode and "F_RDAHEAD" in advisor.mode
    assert advisor.release_mode.startswith("msync(MS_INVALIDATE)") and not advisor.populate
    assert ("fcntl", F_RDAHEAD, 0) in libc.calls and ("mmap", 16 * MiB) in libc.calls

    want = [(MiB + 100, 3 * MiB), (9 * MiB, 2 * MiB)]
    asked = advisor.prefetch(want, sequential=True)
    assert asked == 3 * MiB + PAGE + 2 * MiB  # whole pages
    assert resident_bytes(model_file, want) >= 5 * MiB  # the bytes came in
    assert not [c for c in libc.calls if c[0] == "madvise"]  # no MADV_POPULATE_READ, nor any other advice

    assert advisor.release(want) == asked
    msyncs = [c for c in libc.calls if c[0] == "msync"]
    assert msyncs == [("msync", libc.base + MiB, 3 * MiB + PAGE, MS_INVALIDATE),
                      ("msync", libc.base + 9 * MiB, 2 * MiB, MS_INVALIDATE)]
    advisor.close()
    assert libc.calls[-1] == ("munmap", libc.base, 16 * MiB)


def test_macos_release_failures(model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_on_macos(monkeypatch, preadv=True)
    advisor = Advisor(str(model_file), platform="darwin", libc=DarwinLibc(msync_result=-1))
    with pytest.raises(OSError, match=r"msync\(MS_INVALIDATE\)"):
        advisor.release([(0, MiB)])
    advisor.close()
    unmapped = Advisor(str(model_file), platform="darwin", libc=DarwinLibc(can_map=False))
    assert unmapped.release_mode.startswith("none") and unmapped.release([(0, MiB)]) == 0
    assert unmapped.prefetch([(0, MiB)]) == MiB
    unmapped.close()


def test_dropping_a_file_from_the_cache_on_macos(model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """memory.drop_file_cache where Python has no posix_fadvise: on macOS the advisor's release, msync(MS_INVALIDATE)
    over the ranges' whole pages on a mapping of its own; elsewhere a clear error."""
    _as_on_macos(monkeypatch, preadv=True)
    libc = DarwinLibc()
    drop_file_cache(model_file, [(MiB + 100, 3 * MiB), (9 * MiB, 2 * MiB)], platform="darwin", libc=libc)
    assert [c for c in libc.calls if c[0] == "msync"] == [("msync", libc.base + MiB, 3 * MiB + PAGE, MS_INVALIDATE),
                                                          ("msync", libc.base + 9 * MiB, 2 * MiB, MS_INVALIDATE)]
    assert libc.calls[-1] == ("munmap", libc.base, 16 * MiB)
    libc = DarwinLibc()
    drop_file_cache(model_file, platform="darwin", libc=libc)  # the whole file
    assert [c for c in libc.calls if c[0] == "msync"] == [("msync", libc.base, 16 * MiB, MS_INVALIDATE)]
    with pytest.raises(OSError, match=r"msync\(MS_INVALIDATE\) of .* failed"):
        drop_file_cache(model_file, [(0, MiB)], platform="darwin", libc=DarwinLibc(msync_result=-1))
    with pytest.raises(OSError, match="could not be mapped"):
        drop_file_cache(model_file, [(0, MiB)], platform="darwin", libc=DarwinLibc(can_map=False))
    with pytest.raises(OSError, match="no os.posix_fadvise"):
        drop_file_cache(model_file, platform="linux")
    # as a macOS process calls it: this platform's choice, the real libc (msync succeeds here too)
    monkeypatch.setattr(advice, "paging_platform", lambda name=None: "darwin")
    drop_file_cache(model_file, [(0, MiB)])


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="drops the file from the page cache to measure")
def test_the_prefetcher_streams_with_the_macos_advice(model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetcher as a node runs it, with the Advisor on its macOS path (this machine's libc: fcntl F_RDAHEAD
    fails here, msync(MS_INVALIDATE) succeeds) and no per-thread fault counts, as on macOS."""
    from primaplug.memory.policy import plan_prefetch
    from primaplug.memory.prefetcher import Prefetcher

    _drop(model_file)
    _as_on_macos(monkeypatch, preadv=True)
    monkeypatch.setattr(advice, "paging_platform", lambda name=None: "darwin")
    monkeypatch.delattr(resource, "RUSAGE_THREAD")
    assert thread_major_faults() == 0 and thread_major_faults(2**22 + 7) == 0
    windows = [[(0, 4 * MiB)], [(4 * MiB, 4 * MiB)], [(8 * MiB, 4 * MiB)]]
    plan = plan_prefetch(windows, 9 * MiB, keep=False)
    assert plan.mode == "stream"
    p = Prefetcher(str(model_file), plan)
    try:
        assert "unified buffer cache" in p.mode and "read-ahead on" in p.mode
        assert p.wait_idle(10)
        for i in range(3):
            p.window_started(i)
            p.window_done(i, last_of_token=i == 2)
            assert p.wait_idle(10)
        assert p.stats.bytes_prefetched >= 8 * MiB and p.stats.bytes_released == 12 * MiB
        assert p.stats.tokens == 1
    finally:
        p.close()
