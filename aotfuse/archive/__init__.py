"""The single-file .aotf archive: manifest + zstd parts + mmap-able weights. Spec: artifacts/FORMAT.md."""
from .format import (
    FORMAT_VERSION,
    MIN_SUPPORTED_VERSION,
    Archive,
    read_archive,
    save_archive,
    write_archive,
)

__all__ = ["FORMAT_VERSION", "MIN_SUPPORTED_VERSION", "Archive", "read_archive", "save_archive",
           "write_archive"]
