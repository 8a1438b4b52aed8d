"""Memory of a node: what to keep, prefetch and release (policy), doing it (advice, prefetcher), and measuring it
(residency, system). Linux-first through ctypes; other platforms fall back and say which mode they use."""

from primaplug.memory.residency import drop_file_cache, resident_bytes

__all__ = ["drop_file_cache", "resident_bytes"]
