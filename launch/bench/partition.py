"""A network partition of one host, on one machine: the job goes on without it, and it rejoins once healed.

Must run in a private network namespace (`unshare --net`, which needs CAP_NET_ADMIN), so that the
routing rules below touch nothing outside it:

    unshare --net python -m launch.bench.partition --root /tmp/partition

Three agents advertise 127.0.0.1, 127.0.0.2 and 127.0.0.3 and share one etcd; the third reaches etcd
on 127.0.0.3. Policy-routing rules then drop every packet to or from 127.0.0.3, existing connections
included: that host's store endpoint and its worker's TF server are cut off, as behind a failed
switch. (No iptables or traffic-control modules are needed: only `ip rule`.) The job's records are
left in ROOT/run for the caller to check.
"""
import json
import subprocess
import time
from pathlib import Path
from typing import Dict

from absl import app, flags

from tf_elastic.elastic.flag_checks import require_finite_floats
from tf_elastic.testing.etcd_server import EtcdServer
from tf_elastic.testing.local_job import LocalJob, stop_jobs_on_sigterm
from tf_elastic.testing.soak import TRAIN

CUT = "127.0.0.3"  # the partitioned host's address
_LOCAL_TABLE_PREF = 100  # where the `local` routing table moves, so that the cut's rules come first

FLAGS = flags.FLAGS
flags.DEFINE_string("root", None, "Directory for the job's run dir and logs.", required=True)
flags.DEFINE_float("partition_seconds", 10.0, "Least time the host stays cut off (and at least until the others "
                   "train without it).", lower_bound=1.0)
flags.DEFINE_integer("epochs", 40, "Epochs of the job (digits: about two seconds each).", lower_bound=10)
require_finite_floats(__name__)


def _ip_rules(*commands: str) -> None:
    for command in commands:
        subprocess.run(["ip", "rule", *command.split()], check=True)


def cut(addr: str) -> None:
    """Drops every packet to or from `addr` (this namespace only)."""
    _ip_rules(f"add pref 10 to {addr} blackhole", f"add pref 11 from {addr} blackhole",
              f"add pref {_LOCAL_TABLE_PREF} lookup local", "del pref 0")


def heal(addr: str) -> None:
    _ip_rules("add pref 0 lookup local", f"del pref {_LOCAL_TABLE_PREF}", f"del pref 10 to {addr}",
              f"del pref 11 from {addr}")


def run(root: Path, partition_seconds: float, epochs: int) -> Dict[str, float]:
    """Returns the moments of the cut and the heal, and how long the job took to train again after each."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    if [line.split(":")[1].strip() for line in links.splitlines()] != ["lo"]:
        raise app.UsageError("launch.bench.partition changes routing rules: run it in a network namespace of its own "
                             "(only a loopback interface), unshare --net python -m launch.bench.partition ...")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # a new namespace's loopback starts down
    root.mkdir(parents=True, exist_ok=True)
    etcd = EtcdServer(hosts=("127.0.0.1", CUT)).start()
    job = LocalJob(root, TRAIN + [f"--epochs={epochs}"], ["--min_workers=1", "--max_workers=3", "--index_log",
                                                          "--last_call=1"],
                   rdzv=etcd.url, trainer="launch.train")
    try:
        job.start_agent("a", advertise_addr="127.0.0.1")
        job.start_agent("b", advertise_addr="127.0.0.2")
        job.start_agent("c", advertise_addr=CUT, rdzv=etcd.url_on(CUT))
        job.first_step_after(0, world_size=3, timeout=300)
        time.sleep(2.0)  # a few steps at full size
        cut_at = time.time()
        cut(CUT)
        try:
            without = job.first_step_after(cut_at, world_size=2, timeout=120)
            time.sleep(max(0.0, cut_at + partition_seconds - time.time()))
        finally:
            healed_at = time.time()
            heal(CUT)
        back = job.first_step_after(healed_at, world_size=3, timeout=180)
        codes = job.wait_agents(timeout=900)
    finally:
        job.cleanup()
        etcd.close()
    return {"cut": cut_at, "healed": healed_at, "training_without_it_after": without["time"] - cut_at,
            "training_with_it_again_after": back["time"] - healed_at, "agent_codes": codes}


def main(argv):
    del argv
    stop_jobs_on_sigterm()
    result = run(Path(FLAGS.root), FLAGS.partition_seconds, FLAGS.epochs)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
