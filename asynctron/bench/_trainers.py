"""A trainer's thread for the busy-trainer benchmarks: pure Python that holds the GIL (the
worst case of a GPU trainer's dispatch thread), Python with a tiny torch op every few
microseconds (a dispatch thread launching kernels: it gives the GIL up at each op), or 1-thread
torch matmuls that take a core."""

from __future__ import annotations

import os
import threading

import torch


class TrainerThread(threading.Thread):
    """Works in units until stopped, counting them: pure Python (`python`), 20 tiny in-place
    torch ops with Python between them (`dispatch`) or a 1-thread 256x256 matmul (`torch`);
    on `cpus` only, if given (a trainer bound to its cores)."""

    def __init__(self, kind: str, cpus: set[int] | None = None) -> None:
        super().__init__(name=f"trainer-{kind}", daemon=True)
        self.kind = kind
        self.cpus = cpus
        self.count = 0
        self._halt = threading.Event()

    def run(self) -> None:
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)  # this thread only
        torch.set_num_threads(1)  # per thread: a new thread's matmuls would use every core
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        tiny = torch.zeros(16)
        while not self._halt.is_set():
            if self.kind == "python":
                total = 0
                for i in range(2000):
                    total += i * i
            elif self.kind == "dispatch":
                for _ in range(20):
                    tiny.add_(1)
                    total = 0
                    for i in range(50):
                        total += i * i
            else:
                torch.mm(a, b)
            self.count += 1

    def stop(self) -> None:
        self._halt.set()
        self.join()
