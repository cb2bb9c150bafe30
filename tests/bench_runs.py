"""Benchmark processes a smoke-test module starts side by side (``Runs``): each test checks the
output of its own runs while the other tests' runs go on beside them."""

import subprocess
import sys


class Runs:
    """Processes started together and collected by name. The runs are mostly interpreter
    start-ups, single-threaded phases and waits between processes: started at once, a module
    takes the time of its longest chain, not the sum."""

    def __init__(self, env: dict, cwd=None):
        self.env, self.cwd = env, cwd
        self.procs, self.outs = {}, {}

    def start(self, name, arg_lists) -> "Runs":
        """Start ``python *args`` for each of ``arg_lists`` under ``name``."""
        self.procs[name] = [
            subprocess.Popen(
                [sys.executable, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=self.cwd,
                env=self.env,
            )
            for args in arg_lists
        ]
        return self

    def stdouts(self, name) -> list:
        """The stdouts of ``name``'s runs, once they all ended with 0 (else an assertion error
        with the failed run's output)."""
        if name not in self.outs:
            procs = self.procs[name]
            try:
                self.outs[name] = [proc.communicate(timeout=600) for proc in procs]
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
        for proc, (stdout, stderr) in zip(self.procs[name], self.outs[name]):
            assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        return [stdout for stdout, _ in self.outs[name]]

    def close(self):
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
