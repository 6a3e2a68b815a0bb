"""Ray for a sweep or a search: embedded on this machine (listening on loopback only) or
attached to a cluster (``RAY_ADDRESS`` or ``sweep.ray_address``), checked before any trial
is queued: an unreachable address and a trial no node can fit fail in seconds."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from pipeline.errors import SweepError


def ray_address(params: dict[str, Any]) -> str | None:
    return os.environ.get("RAY_ADDRESS") or params["sweep"].get("ray_address")


def check_ray_address(address: str, timeout: float = 5.0) -> None:
    """Fail within seconds naming an unreachable ``host:port`` instead of hanging."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise SweepError(f"Ray address {address!r} is not 'auto' or host:port")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        raise SweepError(f"Ray cluster at {address} is unreachable ({err})") from None


def start_ray(params: dict[str, Any]) -> None:
    import ray

    address = ray_address(params)
    if address:
        check_ray_address(address)
        if _is_loopback(address):
            # A cluster on this machine's loopback (tests, a workstation's `ray start`):
            # without this Ray rewrites 127.0.0.1 to the routable address and misses it.
            _loopback_only()
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        _loopback_only()
        _watch_driver()
        # A fresh instance on this machine's loopback alone: Ray's token authentication is
        # for clusters others can reach, and its warning, three times a run, only says so.
        # Attached to a cluster (above), token auth stays as the user set it.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # "local" always starts a fresh instance; plain ray.init() silently attaches to any
        # cluster already running on the machine.
        ray.init(
            address="local",
            num_cpus=params["sweep"].get("num_cpus"),
            include_dashboard=False,
            logging_level=logging.WARNING,  # not "Started a local Ray instance"
        )


_WATCHED: set[int] = set()


def _watch_driver() -> None:
    """Once per driver process: Ray's processes end with it, even if it is killed
    (``pipeline.sweep.reaper``)."""
    if os.getpid() not in _WATCHED:
        from pipeline.sweep.reaper import watch

        watch()
        _WATCHED.add(os.getpid())


def _is_loopback(address: str) -> bool:
    host = address.split("://", 1)[-1].rpartition(":")[0]
    return host == "localhost" or host.startswith("127.") or host == "[::1]"


def _loopback_only() -> None:
    """Keep an embedded Ray on 127.0.0.1.

    On Linux Ray replaces 127.0.0.1 by the machine's routable address and binds its gRPC
    servers to every interface, so a laptop sweep would be reachable from the network.
    Ray's switch for "no multi-node cluster" (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``)
    makes it use loopback; it is read when ray is imported, hence the attribute too.
    Only for the embedded instance: a driver attached to a real cluster must advertise a
    routable address. A value the user set is respected.
    """
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") is not None:
        return
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # for the processes Ray spawns
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):  # a Ray without the switch: nothing to do
        pass


def quiet_tune_output() -> None:
    """Under a driver's own progress lines: Tune's newer output prints its experiment table,
    results folder and a TensorBoard hint even when silent (``verbose=0``); its older one,
    silent, prints nothing."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")


def check_resources(params: dict[str, Any]) -> None:
    """Fail now, not after trials pend forever, if no node can fit one trial."""
    import ray

    sweep = params["sweep"]
    have = ray.cluster_resources()
    for key, name in (("cpus_per_trial", "CPU"), ("gpus_per_trial", "GPU")):
        want = sweep.get(key, 1 if name == "CPU" else 0)
        if want and have.get(name, 0) < want:
            raise SweepError(f"sweep.{key}={want} but the Ray cluster has {have.get(name, 0):g} {name}s")
