"""How fast this host writes rows into fresh /dev/shm files, the step read_batched's
worker takes: 256 tensors of 256 x 512 fp32 rows (134 MB), one writev from their own
memory, and the same split over 1, 2 and 4 threads (pwritev at each part's offset).

    python3 scripts/probe_shm_write.py
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

ROWS, WIDTH, TENSORS = 256, 512, 256
steps = [torch.randn(2048, WIDTH) for _ in range(TENSORS * ROWS // 2048)]
chunks = [steps[i * ROWS // 2048][(i * ROWS) % 2048 :][:ROWS] for i in range(TENSORS)]
total = sum(chunk.numel() * chunk.element_size() for chunk in chunks)
pool = ThreadPoolExecutor(4)


def write(threads: int) -> float:
    path = f"/dev/shm/probe-shm-write-{os.getpid()}"
    views = [memoryview(chunk.view(torch.uint8).numpy()) for chunk in chunks]
    offsets = [0]
    for view in views:
        offsets.append(offsets[-1] + view.nbytes)
    start = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    if threads == 0:
        os.writev(fd, views)
    else:
        parts = [(i * len(views) // threads, (i + 1) * len(views) // threads) for i in range(threads)]
        list(pool.map(lambda part: os.pwritev(fd, views[part[0] : part[1]], offsets[part[0]]), parts))
    os.close(fd)
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


for _round in range(3):
    for threads in (0, 1, 2, 4):
        seconds = write(threads)
        label = "one writev" if threads == 0 else f"{threads} thread(s)"
        print(f"{label:12} {total / 1e6:.0f} MB in {seconds * 1e3:.1f} ms: {total / seconds / 1e9:.2f} GB/s")
