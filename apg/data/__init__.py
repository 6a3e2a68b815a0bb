"""Dataset files (plain ``.npz``) and the MNIST IDX loader."""

from apg.data.files import (
    IN_MEMORY_MAX_BYTES,
    DatasetError,
    Rows,
    StoredRows,
    atomic_write,
    load_dataset,
    save_dataset,
    training_rows,
)

__all__ = [
    "IN_MEMORY_MAX_BYTES",
    "DatasetError",
    "Rows",
    "StoredRows",
    "atomic_write",
    "load_dataset",
    "save_dataset",
    "training_rows",
]
