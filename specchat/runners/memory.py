"""Returning memory to the OS after loading: weights copied out of the checkpoint's file mapping
(or, for a table read a row at a time, left there with its pages dropped), freed buffers
trimmed."""

import ctypes
import os

import torch

MADV_RANDOM, MADV_DONTNEED, MADV_PAGEOUT = 1, 4, 21


def _madvise(start: int, end: int, advice: int) -> bool:
    """madvise over the whole pages inside [start, end) (Linux; elsewhere nothing). Returns
    whether the kernel took the advice."""
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = -(-start // page) * page, end // page * page
    if end <= start:
        return True
    try:
        madvise = ctypes.CDLL("libc.so.6").madvise
    except (OSError, AttributeError):
        return False
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0


def _file_mappings(under: str = "/") -> list[tuple[int, int]]:
    """(start, end) of this process's memory mappings of files under `under` (Linux), else
    []."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    spans = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(under):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


class SheddingPages:
    """While a checkpoint under `folder` loads: a thread that, every `interval` seconds, asks
    the kernel to reclaim this process's pages of its files' mappings (MADV_PAGEOUT, Linux 5.4
    on; elsewhere nothing). transformers keeps every shard mapped until the load ends, so each
    page the quantization read would stay resident with it: at Llama 3.1 8B's shape 16 GB of
    bf16 on top of the 4-bit weights made from them. A reclaimed page is read again from the
    file if anything touches it; a page written since it was mapped (copy-on-write) is never
    dropped (PAGEOUT keeps contents, unlike MADV_DONTNEED)."""

    def __init__(self, folder: str | os.PathLike, interval: float = 0.2):
        import threading

        self.folder, self.interval = os.path.realpath(folder), interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specchat-shed-pages",
                                        daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.shed()

    def shed(self) -> bool:
        """One pass; whether the kernel took the advice on every mapping."""
        return all([_madvise(start, end, MADV_PAGEOUT)
                    for start, end in _file_mappings(self.folder + os.sep)])

    def __enter__(self) -> "SheddingPages":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _copy_out_of_file_mapping(model, chunk_bytes: int = 16 << 20, keep=()) -> None:
    """Move the weights that stayed views of the memory-mapped checkpoint into memory we own.

    On CPU the unquantized tensors (the bf16 tied embedding and the norms) are slices of the
    safetensors file's mapping, which keeps every page it ever read resident: the embedding and
    the bf16 sources of the weights already quantized. Copying the tensors out (a chunk at a
    time, dropping each source chunk's pages as it goes) lets the mapping close, with no
    transient peak.

    `keep`: tensors that stay in the mapping, read a row at a time (an embedding table whose
    LM head reads a copy of its own): their pages are dropped and read again as rows are looked
    up, one page at a time (`drop_read_pages` drops them again once loading is done). Nothing
    may write to them: a page dropped from the private mapping comes back as the file has it."""
    spans = _file_mappings()
    if not spans:
        return
    kept = {t.data_ptr() for t in keep}
    model._kept_in_file = [t for t in keep if any(s <= t.data_ptr() < e for s, e in spans)]
    tensors = [t for t in (*model.parameters(), *model.buffers())
               if t.device.type == "cpu" and type(t).__name__ != "Params4bit"
               and any(s <= t.data_ptr() < e for s, e in spans)]
    if not tensors:
        return
    extents = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    with torch.no_grad():
        # First the pages between those tensors (the sources of the weights already quantized,
        # the header): no tensor reads them any more.
        for start, end in spans:
            if any(start <= a < end for a, _ in extents):
                edge = start
                for a, b in extents:
                    if start <= a < end:
                        _madvise(edge, a, MADV_DONTNEED)
                        edge = max(edge, b)
                _madvise(edge, end, MADV_DONTNEED)
        for t in tensors:  # then each tensor, copied out a chunk at a time
            if t.data_ptr() in kept:
                end = t.data_ptr() + t.numel() * t.element_size()
                _madvise(t.data_ptr(), end, MADV_RANDOM)  # a lookup reads its own page only
                _madvise(t.data_ptr(), end, MADV_DONTNEED)
                continue
            if not t.is_contiguous():
                t.data = t.data.clone()
                continue
            flat, own = t.data.view(-1), torch.empty(t.numel(), dtype=t.dtype)
            step = max(1, chunk_bytes // t.element_size())
            for i in range(0, flat.numel(), step):
                part = flat[i:i + step]
                own[i:i + step] = part
                _madvise(part.data_ptr(), part.data_ptr() + part.numel() * part.element_size(),
                         MADV_DONTNEED)
            t.data = own.view(t.shape)


def drop_read_pages(model) -> None:
    """Drop the pages read so far of the tables `_copy_out_of_file_mapping` kept in the
    checkpoint's mapping (none elsewhere): loading read many of their rows (a draft head's rows
    of the LM head, the proof's lookups), and what decoding reads comes back a page at a
    time."""
    spans = _file_mappings()
    for t in getattr(model, "_kept_in_file", ()):
        if any(s <= t.data_ptr() < e for s, e in spans):  # (not replaced since)
            _madvise(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), MADV_DONTNEED)


def _return_large_buffers_to_os(threshold: int = 1 << 20) -> None:
    """Serve allocations of 1 MB and more (weights being quantized, logits, activations) from
    their own mappings, returned to the OS when freed. glibc otherwise raises this threshold as
    it goes and serves them from the heap, which fragments and only grows: resident memory after
    loading would vary between identical runs. With this it is the same every time. Loading ends
    with `_keep_step_buffers`."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc


def _keep_step_buffers(threshold: int = 32 << 20, trim: int = 128 << 20) -> None:
    """Once loaded: serve buffers under 32 MB from the heap and keep up to 128 MB of freed heap,
    so that a decoding step's buffers (logits, 1 MB a row of a 262k vocabulary; the sampler's
    temporaries) reuse the previous step's memory. From fresh mappings, every such buffer pays
    a page fault per 4 KB at every step, which costs more than the arithmetic on it
    (docs/cpu.md)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, trim)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc


def release_freed_memory() -> None:
    """Hand the loader's freed buffers back to the OS (glibc keeps them otherwise): ~0.4 GB
    less resident memory after loading the embedded model."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc (macOS, Windows): nothing to do


M_ARENA_MAX = -8  # glibc's mallopt parameter
MALLOC_ARENAS = 2


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas (unless MALLOC_ARENA_MAX is set). A server runs each reply in
    a thread of its own, and glibc gives threads arenas of their own, up to 8 a core, each
    keeping what its threads freed: on the embedded model resident memory rose 12% over 60
    soak sequences at glibc's default and 3% with one arena (tests/soak.py). One reply runs at
    a time, so a few arenas cost no contention. True where the cap was set (glibc only)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))
