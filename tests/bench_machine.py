"""What every benchmark result must say about the machine it ran on (benchmarks/models.py's
``machine()``): the smoke tests check their run's JSON and stdout with ``assert_names_machine``."""


def assert_names_machine(result: dict, stdout: str, threads=None) -> dict:
    """``result["machine"]`` names the CPU and the kernels' ISA (non-empty), the cores and the
    threads (integers, or the list of a sweep's; ``threads``: what is expected), and ``stdout`` has
    the table header's
    ``machine: `` line with the same CPU."""
    m = result["machine"]
    assert isinstance(m["cpu"], str) and m["cpu"].strip(), m
    assert isinstance(m["isa"], str) and m["isa"].strip(), m
    assert isinstance(m["kernel_build"], str) and m["kernel_build"], m
    assert type(m["cores"]) is int and m["cores"] >= 1, m
    threads_of = (
        m["threads"] if isinstance(m["threads"], list) else [m["threads"]]
    )  # a list: a sweep's counts
    assert threads_of and all(type(t) is int and t >= 1 for t in threads_of), m
    if threads is not None:
        assert m["threads"] == threads, m
    lines = [ln for ln in stdout.splitlines() if "machine: " in ln]
    assert lines and any(m["cpu"] in ln and m["isa"] in ln for ln in lines), stdout[-3000:]
    return m
