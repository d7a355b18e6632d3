"""A real SLURM on this machine, for tests and for trying paratrain's SLURM support by hand.

``LocalSlurm`` starts, as root, a munge daemon on a private socket, ``slurmctld`` and one ``slurmd``, in a folder
and on ports of their own; given an ``EmulatedCluster`` (cluster/hosts.py) it starts one ``slurmd`` in each
emulated host instead, so that jobs' tasks run on the hosts. Node names resolve through /etc/hosts entries.
``stop()`` ends every daemon, removes the folder and the entries; ``env()`` gives ``SLURM_CONF``; ``missing()``
says in one line what keeps it from starting here (it needs Debian's ``slurm-wlm`` and ``munge``:
``scripts/install_slurm.sh``), or None.

    python -m paratrain.testing_slurm      # starts one, prints its SLURM_CONF, Ctrl-C ends it
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.comm.transport import free_port

if TYPE_CHECKING:
    from paratrain.cluster.hosts import EmulatedCluster

DAEMONS = ("munged", "slurmctld", "slurmd")
HOSTS_FILE = Path("/etc/hosts")
CLIENTS = ("sinfo", "srun", "sbatch", "scontrol")

#: The CPUs this host offers its jobs: more than it has, so that a test's 3 tasks fit on
#: 2 cores (each task mostly waits on its peers).
CPUS = 8

CONFIG = """\
ClusterName=paratrain
SlurmctldHost={host}({controller})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.sock
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=2
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing() -> str | None:
    """Why a local SLURM cannot start here (one line), or None."""
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): bash scripts/install_slurm.sh"
    if os.geteuid() != 0:
        return "a local SLURM runs its daemons as root"
    return None


class LocalSlurm:
    """One SLURM controller and its compute nodes (this host, or each host of ``hosts``),
    started on construction."""

    def __init__(self, timeout: float = 30.0, hosts: EmulatedCluster | None = None):
        reason = missing()
        if reason:
            raise RuntimeError(reason)
        self.folder = Path(tempfile.mkdtemp(prefix="paratrain-slurm-"))
        self.host = socket.gethostname().split(".")[0]
        self.hosts = hosts
        self.nodes = [f"{hosts.prefix}{h.name}" for h in hosts.hosts] if hosts is not None else [self.host]
        self._marker = f"# {self.folder.name}"  # the /etc/hosts lines this SLURM added end so
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def env(self) -> dict[str, str]:
        """The environment of a command that talks to this SLURM (over this process's)."""
        return {**os.environ, "SLURM_CONF": str(self.folder / "slurm.conf")}

    def _start(self, timeout: float) -> None:
        folder = self.folder
        (folder / "state").mkdir()
        key = folder / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        subprocess.run(
            [
                "munged",
                "-f",
                f"--socket={folder}/munge.sock",
                f"--key-file={key}",
                f"--log-file={folder}/munged.log",
                f"--pid-file={folder}/munged.pid",
                f"--seed-file={folder}/munged.seed",
            ],
            check=True,
        )
        conf = folder / "slurm.conf"
        if self.hosts is None:
            controller, nodes = "127.0.0.1", [f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN"]
        else:  # the controller on the hosts' bridge (the cluster's head address), a node on each host
            controller = self.hosts.head_address
            named = list(zip(self.nodes, self.hosts.hosts))
            nodes = [f"NodeName={name} NodeAddr={h.address} CPUs={CPUS} State=UNKNOWN" for name, h in named]
            with HOSTS_FILE.open("a") as names:
                names.writelines(f"{h.address} {name} {self._marker}\n" for name, h in named)
        conf.write_text(
            CONFIG.format(
                host=self.host,
                controller=controller,
                folder=folder,
                nodes="\n".join(nodes),
                ctld_port=free_port(),
                slurmd_port=free_port(),
            )
        )
        subprocess.run(["slurmctld", "-f", str(conf)], check=True, env=self.env())
        if self.hosts is None:
            subprocess.run(["slurmd", "-f", str(conf)], check=True, env=self.env())
        for name, host in zip(self.nodes, self.hosts.hosts) if self.hosts is not None else []:
            slurmd = ["slurmd", "-f", str(conf), "-N", name]
            subprocess.run(self.hosts.command(host, slurmd, hostname=name), check=True, env=self.env())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=self.env())
            if state.stdout.split() == ["idle"] * len(self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the local SLURM's nodes did not come up within {timeout:g} s (logs in {folder})")

    def run(self, *command: str, timeout: float = 240, **options) -> subprocess.CompletedProcess:
        """A command against this SLURM (``srun ...``, ``sbatch ...``), its output captured."""
        return subprocess.run(
            command, capture_output=True, text=True, env=options.pop("env", self.env()), timeout=timeout, **options
        )

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields of job ``job`` (JobState, Reason, Restarts, ...)."""
        shown = self.run("scontrol", "show", "job", job).stdout.split()
        return dict(word.split("=", 1) for word in shown if "=" in word)

    def wait_for_job(self, job: str, timeout: float = 240) -> str:
        """Until job ``job`` has ended: its final state (COMPLETED, FAILED, ...). A requeued
        job waits about two minutes before it may start again (SLURM's begin time, the
        lifetime of the credential its first run's nodes revoked): here it starts 2 s after
        it is seen pending, when a new credential is newer than the revocation. (A node
        refuses a credential made in the second it revoked the job's: started at once, the
        job died "Job credential revoked" and ended FAILED.)"""
        deadline = time.monotonic() + timeout
        ended: tuple[str, float] | None = None  # a final state, and when it was first seen
        pending: float | None = None  # when the requeued job was first seen waiting for its begin time
        while time.monotonic() < deadline:
            fields = self.job(job)
            state = fields.get("JobState", "")
            if state == "PENDING" and fields.get("Reason") == "BeginTime":
                pending = pending or time.monotonic()
                if time.monotonic() - pending >= 2.0:
                    self.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            else:
                pending = None
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
                # A final state is one that holds: a job that requeues itself as its batch
                # script ends passes through states read between its two runs (a requeue test
                # read FAILED for more than 2 s in a loaded suite, after its stop at step 228).
                # COMPLETED holds after 2 s, any other state after 10.
                hold = 2.0 if state == "COMPLETED" else 10.0
                if ended is None or ended[0] != state:
                    ended = (state, time.monotonic())
                elif time.monotonic() - ended[1] >= hold:
                    return state
            else:
                ended = None
            time.sleep(0.5)
        fields = self.job(job)
        raise TimeoutError(
            f"job {job} did not end within {timeout:g} s: {fields.get('JobState')} ({fields.get('Reason')}) on "
            f"{fields.get('NodeList')}; logs in {self.folder}"
        )

    def stop(self) -> None:
        """End every daemon started here (and their jobs), remove the folder."""
        pid_files = sorted(self.folder.glob("slurmd-*.pid")) + [self.folder / f"{d}.pid" for d in DAEMONS[1::-1]]
        for pid_file in pid_files:
            if pid_file.exists():
                try:
                    pid = int(pid_file.read_text().split()[0])
                    os.kill(pid, signal.SIGTERM)
                    for _ in range(100):
                        os.kill(pid, 0)
                        time.sleep(0.05)
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, ValueError, IndexError):
                    pass
        if self.hosts is not None and HOSTS_FILE.exists():
            # Rewritten in place, never emptied: another SLURM's daemons on this machine resolve
            # their own names through it meanwhile (a truncated file failed a job's launch).
            with HOSTS_FILE.open("r+") as names:
                kept = "".join(line for line in names if not line.rstrip().endswith(self._marker))
                names.seek(0)
                names.write(kept)
                names.truncate()
        shutil.rmtree(self.folder, ignore_errors=True)


if __name__ == "__main__":
    cluster = LocalSlurm()
    print(f"export SLURM_CONF={cluster.folder / 'slurm.conf'}   # node {cluster.host}; Ctrl-C stops it", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
