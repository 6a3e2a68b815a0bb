"""Dataset files (plain ``.npz``) and the MNIST IDX loader."""

from apg.data.files import DatasetError, Rows, StoredRows, atomic_write, load_dataset, save_dataset

__all__ = ["DatasetError", "Rows", "StoredRows", "atomic_write", "load_dataset", "save_dataset"]
