"""The engine core's allocator setting (`core_proc.keep_freed_memory`) and its switch."""
from __future__ import annotations

import pytest

from kvrelay.engine import core_proc


class FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


def test_default_keeps_freed_memory_without_mmap_or_trim(monkeypatch):
    libc = FakeLibc()
    monkeypatch.delenv("KVRELAY_ENGINE_KEEP_FREED_MEMORY", raising=False)
    monkeypatch.setattr(core_proc.ctypes, "CDLL", lambda name: libc)
    assert core_proc.keep_freed_memory() is True
    assert libc.calls == [(-4, 0), (-1, 2**31 - 1)]      # M_MMAP_MAX 0, M_TRIM_THRESHOLD max


def test_zero_leaves_the_allocator_alone(monkeypatch):
    def no_libc(name: str) -> None:
        raise AssertionError("mallopt must not be called")

    monkeypatch.setenv("KVRELAY_ENGINE_KEEP_FREED_MEMORY", "0")
    monkeypatch.setattr(core_proc.ctypes, "CDLL", no_libc)
    assert core_proc.keep_freed_memory() is False


def test_a_bad_value_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("KVRELAY_ENGINE_KEEP_FREED_MEMORY", "yes")
    with pytest.raises(ValueError, match="KVRELAY_ENGINE_KEEP_FREED_MEMORY: expected 0 or 1"):
        core_proc.keep_freed_memory()


def test_without_glibc_it_is_a_no_op(monkeypatch):
    def missing(name: str) -> None:
        raise OSError("libc.so.6: cannot open shared object file")

    monkeypatch.delenv("KVRELAY_ENGINE_KEEP_FREED_MEMORY", raising=False)
    monkeypatch.setattr(core_proc.ctypes, "CDLL", missing)
    assert core_proc.keep_freed_memory() is False
