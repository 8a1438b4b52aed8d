"""Page residency of model files: what is in memory (mincore) and dropping it (posix_fadvise)."""

from primaplug.memory.residency import drop_file_cache, resident_bytes

__all__ = ["drop_file_cache", "resident_bytes"]
