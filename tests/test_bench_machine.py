"""benchmarks/models.py names the machine of every benchmark result: ``machine()`` (CPU model,
the ISA the C kernels are built for, cores, threads), ``machine_line()`` for table headers and
``write_json`` adding ``machine`` to each result (issue #41: numbers move 2x between CPUs)."""

import json
import os

import pytest
import torch

from benchmarks import models
from ringkv.kernels import native


def test_machine_names_cpu_isa_cores_and_threads(monkeypatch):
    monkeypatch.delenv("RINGKV_KERNEL_ISA", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        m = models.machine()
        assert m["threads"] == 1  # at the time of the call
        torch.set_num_threads(2)
        assert models.machine()["threads"] == 2
    finally:
        torch.set_num_threads(before)
    assert m["cpu"].strip() and m["cpu"] == native.cpu_model()
    assert m["kernel_build"] == "native" == native.default_isa()
    best = native.supported_isas()[0]  # -march=native: the best named target this CPU runs
    assert m["isa"] == models.ISA_NAMES[best] and m["isa"].startswith(best)
    assert m["cores"] == os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        assert m["usable_cores"] == len(os.sched_getaffinity(0))
    assert (
        models.machine(threads=3)["threads"] == 3
    )  # the measured processes' count (servers, ranks)
    assert models.machine(threads=(2, 1))["threads"] == [2, 1]  # a sweep's


def test_machine_cpu_is_the_model_name_of_cpuinfo():
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        names = []
    if not names:
        pytest.skip("no model name in /proc/cpuinfo")
    assert models.machine()["cpu"] == names[0]


@pytest.mark.parametrize(
    "isa, label",
    [
        ("x86-64-v3", "x86-64-v3 (AVX2)"),
        ("x86-64-v4", "x86-64-v4 (AVX-512)"),
        ("generic", "generic"),
    ],
)
def test_forced_kernel_isa_is_what_the_machine_says(monkeypatch, isa, label):
    monkeypatch.setenv("RINGKV_KERNEL_ISA", isa)
    m = models.machine()
    assert m["kernel_build"] == isa and m["isa"].startswith(label)
    # a target this CPU cannot run is refused by the kernels (torch paths run): the field says so
    assert (
        (m["isa"] == label) if isa in native.supported_isas() else ("not runnable here" in m["isa"])
    )
    assert f"| {m['isa']} |" in models.machine_line(m)


def test_machine_line_is_one_header_line():
    m = dict(
        cpu="Intel(R) Xeon(R) Processor",
        isa="x86-64-v4 (AVX-512)",
        kernel_build="native",
        cores=2,
        usable_cores=2,
        threads=2,
    )
    assert (
        models.machine_line(m)
        == "machine: Intel(R) Xeon(R) Processor | x86-64-v4 (AVX-512) | 2 cores | 2 threads"
    )
    assert models.machine_line(dict(m, usable_cores=1, threads=[2, 1])) == (
        "machine: Intel(R) Xeon(R) Processor | x86-64-v4 (AVX-512) | 2 cores (1 usable) | "
        "2, 1 threads (per configuration)"
    )
    line = models.machine_line()
    assert line.startswith("machine: ") and "\n" not in line and f"{os.cpu_count()} cores" in line


def test_write_json_adds_the_machine(tmp_path):
    models.write_json(str(tmp_path / "a" / "r.json"), dict(rows=[1]))
    d = json.loads((tmp_path / "a" / "r.json").read_text())
    assert d["rows"] == [1] and d["machine"] == models.machine()
    mine = dict(cpu="x", isa="generic", kernel_build="generic", cores=1, threads=1)
    models.write_json(
        str(tmp_path / "b.json"), dict(rows=[], machine=mine)
    )  # the script's own: kept
    assert json.loads((tmp_path / "b.json").read_text())["machine"] == mine
    models.write_json(str(tmp_path / "c.json"), [1, 2])  # not a dict: as it is
    assert json.loads((tmp_path / "c.json").read_text()) == [1, 2]
