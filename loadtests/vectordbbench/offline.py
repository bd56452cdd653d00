"""Keeps a VectorDBBench run offline. Its custom-dataset case reads local files only, but the package can download
data sets (S3, Aliyun OSS, Hugging Face): in every process of the run, an audit hook refuses name look-ups and
connections to any host but loopback and the ones the command named (the systems under test), so an attempt to
reach out fails loudly, logged as an ERROR, instead of quietly downloading."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys

ENV = "VDBB_ALLOWED_HOSTS"  # comma-separated; set by the command, inherited by every spawned process
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(hosts: list[str]) -> set[str]:
    """The hosts and every address they resolve to (connections name the address)."""
    out = set(hosts)
    for host in hosts:
        try:
            out.update(info[4][0] for info in socket.getaddrinfo(host, None))
        except OSError:
            pass
    return out


def install() -> None:
    allowed = allowed_hosts([h for h in os.environ.get(ENV, "").split(",") if h])

    def refuse(what: str) -> None:
        logging.getLogger("vectordb_bench").error("offline run: refused %s", what)
        raise ConnectionRefusedError(f"offline run: refused {what}")

    def hook(event: str, args: tuple) -> None:
        if event == "socket.getaddrinfo":
            host = args[0].decode() if isinstance(args[0], bytes) else args[0]
            if host and host not in allowed and not _loopback(host):
                refuse(f"a look-up of {host}")
        elif event == "socket.connect":
            sock, address = args
            if (sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in allowed
                    and not _loopback(address[0])):
                refuse(f"a connection to {address[0]}:{address[1]}")

    sys.addaudithook(hook)
