"""Profiles: ``params.yaml`` at another scale, written as overlays of it.

``params.yaml`` is the base (the default CPU-sized run, DVC's params file). Every other
configuration is an overlay under ``profiles/``: ``smoke.yaml``, ``paper.yaml``, and one file
per recorded profile (``paper-gmm.yaml``, ``gpu-bmnist.yaml``, ...). An overlay names the
profile it extends (``extends: paper``; without it, ``params.yaml``) and holds only what it
changes. ``profiles/check/<name>.yaml`` is profile ``name`` under ``paper-check``'s caps (a few
steps, one batch per set): what ``apg-pipeline record <name> --check`` runs.

How an overlay is laid over what it extends (:func:`merge`, the one place it happens):

- a mapping merges key by key, recursively;
- any other value replaces what was there: a scalar, ``null`` (a value here:
  ``sweep.ray_address: null`` means embedded Ray) and a list, which is replaced whole (restate
  the list: a grid, held-out sets);
- ``key: !delete`` removes the key;
- ``key: !replace {...}`` sets the mapping as given instead of merging into it;
- a key the mapping it lands in does not have is an error, and so is deleting one: a typo
  must not add a setting silently. A profile that adds a key (``train.compile``) restates
  the mapping that holds it with ``!replace``.

The result is validated once, as ``params.yaml`` is (:func:`pipeline.config.params.validate_params`).
``apg-pipeline config --profile NAME`` prints it.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from pipeline.config.params import (
    ParamsError,
    _mapping_without_duplicates,
    _StrictLoader,
    load_params,
    read_yaml,
    validate_params,
)
from pipeline.provenance.stages import package_root

BASE = "params.yaml"
PROFILES = "profiles"
CHECKS = "check"  # profiles/check/<name>.yaml: profile <name> under paper-check's caps
EXTENDS = "extends"


class _Delete:
    """``!delete``: the key goes."""


class _Replace(dict):
    """``!replace {...}``: the mapping as given, not merged."""


class _OverlayLoader(_StrictLoader):
    """The params' loader (a key given twice refused) with ``!delete`` and ``!replace``."""


_OverlayLoader.add_constructor("!delete", lambda loader, node: _Delete())
_OverlayLoader.add_constructor(
    "!replace", lambda loader, node: _Replace(_mapping_without_duplicates(loader, node, deep=True))
)


def merge(base: dict[str, Any], overlay: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``overlay`` laid over ``base`` (neither is changed); the rules are the module's.

    Keys keep ``base``'s order. ``ParamsError`` names the dotted key of a key ``base`` lacks."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        at = f"{where}{key}"
        if key not in out:
            verb = "deletes" if isinstance(value, _Delete) else "sets"
            raise ParamsError(
                f"{at}: the overlay {verb} a key that what it extends does not have "
                "(a typo? to add a key, restate its mapping with !replace)"
            )
        if isinstance(value, _Delete):
            del out[key]
        elif isinstance(value, _Replace):
            out[key] = _plain(value)
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = merge(out[key], value, f"{at}.")
        else:
            out[key] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    """``value`` as plain YAML data: no markers left, nothing shared with the overlay."""
    if isinstance(value, _Delete):
        raise ParamsError("!delete stands only as a key's value in a mapping that is merged")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def profiles_dir() -> Path:
    return package_root() / PROFILES


def profile_names() -> list[str]:
    """Every profile, by name (the overlays in ``profiles/``)."""
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def overlay_path(name: str, check: bool = False) -> Path:
    """Profile ``name``'s overlay file (``check``: its check variant); ``ParamsError`` if none."""
    known = profile_names()
    if name not in known:
        raise ParamsError(f"unknown profile {name!r}; known: {', '.join(known)}")
    path = profiles_dir() / (f"{CHECKS}/{name}.yaml" if check else f"{name}.yaml")
    if not path.is_file():
        raise ParamsError(f"profile {name} has no check variant ({PROFILES}/{CHECKS}/{name}.yaml)")
    return path


def read_overlay(path: Path) -> dict[str, Any]:
    return read_yaml(path, _OverlayLoader, mapping=True)


def chain(name: str, check: bool = False) -> list[Path]:
    """The overlays that make profile ``name``, the first laid over ``params.yaml``."""
    paths = [overlay_path(name, check)] + ([overlay_path(name)] if check else [])
    while True:
        parent = read_overlay(paths[-1]).get(EXTENDS)
        if parent is None:
            return paths[::-1]
        path = overlay_path(str(parent))
        if path in paths:
            raise ParamsError(f"profile {name}: {EXTENDS} makes a loop through {path.name}")
        paths.append(path)


def resolve(name: str, check: bool = False, under: dict[str, Any] | None = None) -> dict[str, Any]:
    """Profile ``name``'s params (``check``: its check variant), validated.

    ``under``: params that take the place of what ``name``'s own overlay extends (a profile's
    settings on another scale's data and sizes: the tests run ``paper-gmm`` on the smoke
    profile's)."""
    paths = chain(name, check)
    if under is not None:
        paths = paths[paths.index(overlay_path(name)) :]
        params = copy.deepcopy(under)
    else:
        params = read_yaml(package_root() / BASE)  # validated below, with the overlays on it
    for i, path in enumerate(paths):
        overlay = {k: v for k, v in read_overlay(path).items() if k != EXTENDS}
        try:
            params = merge(params, overlay)
        except ParamsError as err:
            # The usual cause on the first overlay: params.yaml replaced by a profile's copy.
            hint = (
                f"; or {BASE} is not the committed one (git checkout {BASE})"
                if i == 0 and under is None
                else ""
            )
            shown = path.relative_to(package_root()) if path.is_relative_to(package_root()) else path
            raise ParamsError(f"{shown}: {err}{hint}") from None
    try:
        validate_params(params)
    except ParamsError as err:
        raise ParamsError(f"profile {name}: {err}") from None
    return params


def extends(name: str) -> str:
    """What profile ``name`` is laid over, as a file name (``params.yaml`` or an overlay's)."""
    parent = read_overlay(overlay_path(name)).get(EXTENDS)
    return BASE if parent is None else f"{PROFILES}/{parent}.yaml"


def load(source: str | Path) -> dict[str, Any]:
    """Params from a file's path, or else from a profile's name (``paper``, ``smoke``)."""
    path = Path(source)
    if path.is_file() or path.suffix in (".yaml", ".yml") or os.sep in str(source):
        return load_params(path)
    return resolve(str(source))


def dump(params: dict[str, Any], header: str = "") -> str:
    """``params`` as YAML (keys in order, short lists inline), under ``header`` comment lines."""
    text = yaml.safe_dump(params, sort_keys=False, default_flow_style=None, width=110)
    lines = "".join(f"# {line}\n" for line in header.splitlines())
    return lines + text


@contextmanager
def params_file(params: dict[str, Any]) -> Iterator[Path]:
    """``params`` written to a temporary ``params.yaml`` (for a sandbox to copy)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / BASE
        path.write_text(dump(params))
        yield path
