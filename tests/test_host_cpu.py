"""The host CPU's identity and its bfloat16 dot instructions, read from /proc/cpuinfo."""

from __future__ import annotations

import pytest

from fp8jax import host_cpu

ZEN4 = {"model name": "AMD EPYC 9R14", "flags": "fpu avx2 avx512f avx512_bf16"}
ZEN3 = {"model name": "AMD EPYC 7R13", "flags": "fpu sse4_2 avx avx2 fma"}
SAPPHIRE_RAPIDS = {"model name": "Intel(R) Xeon(R)", "flags": "avx2 avx512f amx_bf16 amx_tile"}
NEOVERSE_V1 = {"Features": "fp asimd sve bf16 i8mm"}
NEOVERSE_N1 = {"Features": "fp asimd crc32 atomics"}


@pytest.mark.parametrize(
    "fields,want",
    [
        (ZEN4, True),
        (SAPPHIRE_RAPIDS, True),
        (NEOVERSE_V1, True),
        (ZEN3, False),
        (NEOVERSE_N1, False),
        ({}, None),
    ],
)
def test_has_bf16_dot_reads_the_instruction_sets(monkeypatch, fields, want):
    monkeypatch.setattr(host_cpu, "cpu_fields", lambda: fields)
    assert host_cpu.has_bf16_dot() is want


def test_cpu_model_and_flags(monkeypatch):
    monkeypatch.setattr(host_cpu, "cpu_fields", lambda: ZEN3)
    assert host_cpu.cpu_model() == "AMD EPYC 7R13"
    assert host_cpu.cpu_flags() == frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})
    monkeypatch.setattr(host_cpu, "cpu_fields", lambda: {})
    assert host_cpu.cpu_flags() == frozenset()
    assert isinstance(host_cpu.cpu_model(), str)


def test_cpu_fields_parses_the_first_processor(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: CPU A\nflags\t\t: avx2 avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: CPU B\nflags\t\t: avx2\n"
    )
    monkeypatch.setattr(host_cpu, "_CPUINFO", info)
    host_cpu.cpu_fields.cache_clear()
    try:
        assert host_cpu.cpu_fields() == {
            "processor": "0",
            "model name": "CPU A",
            "flags": "avx2 avx512_bf16",
        }
        monkeypatch.setattr(host_cpu, "_CPUINFO", tmp_path / "missing")
        host_cpu.cpu_fields.cache_clear()
        assert host_cpu.cpu_fields() == {}
    finally:
        host_cpu.cpu_fields.cache_clear()
