"""Seeded simulated sets of a task, as numpy arrays: whole, or in chunks of bounded size.

A set is simulated in chunks of at most ``CHUNK_BYTES`` of arrays, so memory stays bounded
whatever its size (60,000 paper-scale Bouncing MNIST videos take 22 GB at once); written
with :func:`apg.data.save_dataset`, which spools chunks to disk, the file is the same bytes
as the whole set's. A set that fits one chunk (every CPU-sized set) is simulated in one
call, so its draws do not depend on the chunking.

Legend: M datasets in a set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from apg.tasks import get_task

CHUNK_BYTES = 256 * 2**20  # arrays simulated at once, at most (roughly)


def simulate_set(
    task: str, model_hparams: dict[str, Any], num_datasets: int, seed: int, sizes: dict[str, Any]
) -> dict[str, np.ndarray]:
    """One seeded simulated set, whole: ``x (M, ...)`` plus the true latents."""
    chunks = list(simulate_chunks(task, model_hparams, num_datasets, seed, sizes, chunk_bytes=None))
    return {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


def simulate_chunks(
    task: str,
    model_hparams: dict[str, Any],
    num_datasets: int,
    seed: int,
    sizes: dict[str, Any],
    chunk_bytes: int | None = CHUNK_BYTES,
) -> Iterator[dict[str, np.ndarray]]:
    """The set's datasets in order, as dicts of numpy arrays of at most ``chunk_bytes``
    each (``None``: one chunk). All chunks draw from one generator seeded with ``seed``, so
    the set depends on its chunk size only when it needs more than one chunk.

    Raises ``ValueError`` for sizes the simulator does not take or that give empty
    datasets, and for a model that simulates non-finite ``x``.
    """
    spec = get_task(task)
    model = spec.build_model(**model_hparams)

    def simulate(count: int, generator: torch.Generator) -> dict[str, np.ndarray]:
        try:
            with torch.no_grad():
                arrays = spec.simulate(model, count, generator, **sizes)
        except TypeError as err:
            raise ValueError(f"{task}: bad dataset sizes {sizes} ({err})") from None
        if 0 in arrays["x"].shape[1:]:
            shape = tuple(arrays["x"].shape)
            raise ValueError(f"{task}: sizes {sizes} give datasets of no entries ('x' {shape})")
        if not torch.isfinite(arrays["x"]).all():  # a model hyperparameter out of its range
            raise ValueError(
                f"{task}: the model {dict(model_hparams)} simulates NaN or infinite values of 'x'"
            )
        return {k: v.cpu().numpy() for k, v in arrays.items()}

    per_chunk = num_datasets
    if chunk_bytes is not None:  # one dataset's bytes, from a probe with its own generator
        probe = simulate(1, torch.Generator().manual_seed(seed))
        per_chunk = max(1, chunk_bytes // max(1, sum(a.nbytes for a in probe.values())))
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, num_datasets, per_chunk):
        yield simulate(min(per_chunk, num_datasets - start), generator)
