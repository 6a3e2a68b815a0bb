"""Dataset files (plain ``.npz``) and the MNIST IDX loader."""

from apg.data.files import DatasetError, StoredRows, atomic_write, load_dataset, save_dataset

__all__ = ["DatasetError", "StoredRows", "atomic_write", "load_dataset", "save_dataset"]
