"""Two pretend hosts on one machine, and worker processes that cannot outlive the benchmark.

``veth_pair`` creates two network namespaces joined by a veth pair with a private /30 in
10.213.0.0/16, brings up ``lo`` in both and, given a ``rate``, caps each end's egress with
``tc ... tbf`` (netem is not available on these machines: machine-baselines §4). Traffic between
processes in the same namespace never touches the veth (it is delivered locally), so it plays the
fast intra-host link and the veth the slow network. Everything it created is deleted when the
block exits, also on an exception or Ctrl-C. Needs root and iproute2 (``ip``, ``tc``);
``unavailable_reason`` says why not. The tests use the same namespaces as separate machines.

``run_workers`` starts processes in their own sessions, waits for all of them under a deadline and
kills every one still running when it returns or raises (first failure, timeout, interrupt).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213"
"""Only addresses in 10.213.0.0/16 (and loopback) are ever assigned or targeted."""

COMMAND_TIMEOUT_S = 20
"""Limit for each ``ip``/``tc`` call."""


class NetnsUnavailable(RuntimeError):
    """The namespaces or the rate cap could not be set up here; the message says why."""


class WorkerFailed(RuntimeError):
    """A worker exited non-zero or the group ran past its deadline; the message has log tails."""


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its end of the veth pair and that end's address."""

    namespace: str
    interface: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def unavailable_reason() -> str | None:
    """Why ``veth_pair`` cannot work here (not root, no ``ip``/``tc``), or None."""
    if not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root to create network namespaces and tc qdiscs (run as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install iproute2)"
    return None


def stale_namespaces(prefix: str) -> list[str]:
    """Namespaces with ``prefix`` left by earlier runs that were killed before cleaning up."""
    listing = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(prefix)]


@contextlib.contextmanager
def veth_pair(
    prefix: str = "dtb",
    rate: str | None = "1gbit",
    burst: str = "256kb",
    latency: str = "100ms",
) -> Iterator[tuple[Host, Host]]:
    """Yield two hosts joined by a veth pair, capped at ``rate`` each way if given; delete them.

    Raises ``NetnsUnavailable`` (after cleaning up) when any step of the setup fails.
    """
    reason = unavailable_reason()
    if reason:
        raise NetnsUnavailable(reason)
    pid = os.getpid()
    base = (pid % 16384) * 4  # a /30 chosen by pid, so parallel runs do not even look alike
    network = f"{SUBNET}.{base // 256}.{base % 256}"
    hosts = tuple(
        Host(f"{prefix}_{pid}_{end}", f"{prefix}{pid}{end}", f"{SUBNET}.{base // 256}.{offset}")
        for end, offset in (("a", base % 256 + 1), ("b", base % 256 + 2))
    )
    created: list[str] = []
    link_in_root = False
    try:
        try:
            for host in hosts:
                _run(["ip", "netns", "add", host.namespace])
                created.append(host.namespace)
            a, b = hosts[0].interface, hosts[1].interface
            _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
            link_in_root = True
            for host in hosts:
                _run(["ip", "link", "set", host.interface, "netns", host.namespace])
            link_in_root = False
            for host in hosts:
                ns = ["ip", "-n", host.namespace]
                _run([*ns, "addr", "add", f"{host.address}/30", "dev", host.interface])
                _run([*ns, "link", "set", host.interface, "up"])
                _run([*ns, "link", "set", "lo", "up"])
                if rate is None:
                    continue
                tc = ["tc", "-n", host.namespace, "qdisc", "add", "dev", host.interface, "root"]
                _run([*tc, "tbf", "rate", rate, "burst", burst, "latency", latency])
                if "tbf" not in qdisc(host):
                    raise NetnsUnavailable(f"tbf qdisc not active on {host.interface}")
        except subprocess.CalledProcessError as error:
            detail = (error.stderr or "").strip() or f"exit status {error.returncode}"
            raise NetnsUnavailable(f"`{' '.join(error.cmd)}` failed: {detail}") from None
        except subprocess.TimeoutExpired as error:
            raise NetnsUnavailable(f"`{' '.join(error.cmd)}` timed out") from None
        a_host, b_host = hosts
        print(
            f"netns: {a_host.namespace} {a_host.address} <-> {b_host.namespace} "
            f"{b_host.address} (network {network}/30), tbf {rate or 'off'} each way",
            flush=True,
        )
        yield hosts  # type: ignore[misc]
    finally:
        for namespace in created:  # deleting a namespace deletes its end of the pair, and so both
            result = _run(["ip", "netns", "del", namespace], check=False)
            if result.returncode:
                print(f"netns: could not delete {namespace}: {result.stderr.strip()}", flush=True)
        if link_in_root:
            _run(["ip", "link", "del", hosts[0].interface], check=False)


def set_link(host: Host, up: bool) -> None:
    """Take the host's end of the pair down (a cut cable) or bring it back up."""
    state = "up" if up else "down"
    _run(["ip", "-n", host.namespace, "link", "set", host.interface, state])


def qdisc(host: Host) -> str:
    """``tc -s qdisc show`` for the host's veth end (statistics included)."""
    return _run(["tc", "-s", "-n", host.namespace, "qdisc", "show", "dev", host.interface]).stdout


def sent_bytes(host: Host) -> int | None:
    """Bytes the host's root qdisc has sent so far (what left through the cap)."""
    match = re.search(r"Sent (\d+) bytes", qdisc(host))
    return int(match.group(1)) if match else None


def link_bytes(interface: str) -> tuple[int, int] | None:
    """(tx, rx) byte counters of ``interface`` in the caller's namespace, if readable."""
    stats = Path("/sys/class/net") / interface / "statistics"
    try:
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())
    except (OSError, ValueError):
        return None


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (a killed benchmark's workers)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_workers(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    timeout: float,
    log_dir: Path,
) -> None:
    """Run every command to completion; kill all of them on a failure, the deadline or Ctrl-C."""
    procs: list[subprocess.Popen[bytes]] = []
    logs = [log_dir / f"worker{i}.log" for i in range(len(commands))]
    try:
        for command, env, log in zip(commands, envs, logs, strict=True):
            with log.open("wb") as sink:
                procs.append(
                    subprocess.Popen(
                        list(command),
                        env=dict(env),
                        stdin=subprocess.DEVNULL,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # own process group: killed as one, no Ctrl-C
                    )
                )
        deadline = time.monotonic() + timeout
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                i = failed[0]
                raise WorkerFailed(f"worker {i} exited with status {codes[i]}\n{_tails(logs)}")
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                raise WorkerFailed(f"workers still running after {timeout:.0f} s\n{_tails(logs)}")
            time.sleep(0.5)
    finally:
        _stop(procs)


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the process group of each still-running worker, then SIGKILL what remains."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        running = [proc for proc in procs if proc.poll() is None]
        if not running:
            return
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)


def _tails(logs: Sequence[Path], lines: int = 15) -> str:
    parts = []
    for log in logs:
        with contextlib.suppress(OSError):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(text))
    return "\n".join(parts)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), capture_output=True, text=True, check=check, timeout=COMMAND_TIMEOUT_S
    )
