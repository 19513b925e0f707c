"""The C allocator of an HTTP process (the API server, the proxy): large body buffers go
back to the OS once a request is answered."""
from __future__ import annotations

import ctypes

# glibc's mallopt parameters: blocks at least this large are mmapped (and unmapped on free);
# how many malloc arenas threads may spread over
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8
MMAP_THRESHOLD_BYTES = 2**20


def return_large_buffers_to_the_os() -> bool:
    """Fix glibc's mmap threshold at 1 MiB in this process. glibc raises it each time a
    large block is freed, up to 32 MiB, after which a large body's buffers come from the
    heap and stay resident once the request is answered: a 30 MB prompt left +57 MiB
    behind in the API server, now +9 MiB. Not for the engine (a spawned process with
    glibc's default, where torch's tensors reuse heap blocks). False where it is not
    glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def one_arena() -> bool:
    """All threads of this process allocate from one malloc arena. For the proxy, whose
    worker threads (a large body's checks and key) would each grow an arena of their own
    and keep what they freed there: +1-2 MB of RSS per request on 1 MB bodies. Call before
    any thread starts. False where it is not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False
