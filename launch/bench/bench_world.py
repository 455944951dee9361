"""What the world size costs on the worker side: K TensorFlow workers on this machine's loopback, each
building the group's MultiWorkerMirroredStrategy (`worker.strategy.make_strategy`) from a TF_CONFIG and
timing what a new round costs before its first step, for K = 2, 4, 8, 16:

- the strategy: the coordination service, whose leader (rank 0) waits for every task to register;
- the first all-reduce: the collective group is resolved (every rank's devices gathered at the leader)
  and the ring set up;
- the agreement (`group.sum_over_workers`, as `CommittedState` uses it): one SUM all-reduce of a float64
  vector with four slots per rank, median of 20;
- a 16 MiB all-reduce: what a commit's transfer to a joiner costs per 16 MiB of state (the broadcast is
  an all-reduce with zeros from every other rank), median of 5;
- ports: each worker's TF server takes one port per round, fresh, from its host's `--port_range`.

All K workers share this machine's cores, so from K above the cores the times include waiting for a CPU;
the table says how many cores there were. No agent, no store: `launch.bench.bench_rendezvous` measures those.

    python -m launch.bench.bench_world --workers=2,4,8,16
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from absl import app, flags

from tf_elastic.elastic.agent.ports import free_ports
from tf_elastic.elastic.flag_checks import require_finite_floats

flags.DEFINE_list("workers", ["2", "4", "8", "16"], "World sizes to measure (workers on this machine).")
flags.DEFINE_float("timeout", 600.0, "Seconds one world size may take.", lower_bound=1.0)
flags.DEFINE_integer("rank", None, "Internal: run as this rank of a world (the parent sets it).")
flags.DEFINE_string("out", None, "Internal: the file a worker writes its timings to.")
FLAGS = flags.FLAGS
require_finite_floats(__name__)

AGREEMENT_SLOTS = 4  # per rank: commit generation, step, a piece of the state digest, the generation floor
TRANSFER_FLOATS = 2 * 1024 * 1024  # float64: 16 MiB


def _median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        function()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _barrier(directory: Path, rank: int, size: int) -> None:
    """Waits until every rank of the world has reached it (a file each in `directory`)."""
    (directory / f"ready-{rank}").touch()
    while len(list(directory.glob("ready-*"))) < size:
        time.sleep(0.05)


def run_worker(rank: int, out: str) -> None:
    """One rank: import TensorFlow, build the strategy, time the collectives, write the timings."""
    began = time.perf_counter()
    import numpy as np

    from tf_elastic.elastic.worker.group import sum_over_workers
    from tf_elastic.elastic.worker.strategy import make_strategy
    from tf_elastic.elastic.worker.world import World
    imported = time.perf_counter()
    world = World.from_env()
    _barrier(Path(out).parent, rank, world.size)  # the slowest import is not the strategy's time
    ready = time.perf_counter()
    strategy = make_strategy(world, "mwms")
    built = time.perf_counter()
    total = sum_over_workers(strategy, world)
    total([float(rank)])
    first = time.perf_counter()
    agreement = np.zeros(AGREEMENT_SLOTS * world.size)
    agree = _median_seconds(lambda: total(agreement), 20)
    state = np.ones(TRANSFER_FLOATS)
    transfer = _median_seconds(lambda: total(state), 5)
    Path(out).write_text(json.dumps({"rank": rank, "import": imported - began, "strategy": built - ready,
                                     "first": first - built, "agree": agree, "transfer": transfer}))


def measure(size: int, directory: Path) -> List[Dict]:
    """Starts `size` workers with one TF_CONFIG cluster on loopback; their timings, one dict per rank."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(size)]}
    processes = []
    for rank in range(size):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}}))
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "launch.bench.bench_world", f"--rank={rank}", f"--out={directory / f'{rank}.json'}"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(directory / f"{rank}.log", "wb")))
    deadline = time.monotonic() + FLAGS.timeout
    try:
        for rank, process in enumerate(processes):
            if process.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                tail = (directory / f"{rank}.log").read_text(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"world of {size}: rank {rank} exited {process.returncode}: {tail}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [json.loads((directory / f"{rank}.json").read_text()) for rank in range(size)]


def _row(size: int, worst: Dict[str, float], base: Dict[str, float]) -> str:
    cells = [f"{worst['import']:.1f}", f"{worst['strategy']:.2f}", f"{worst['first']:.2f}",
             f"{worst['agree'] * 1000:.1f}", f"{worst['transfer']:.2f}"]
    ratios = " / ".join(f"{worst[k] / base[k]:.1f}x" for k in ("strategy", "first", "agree", "transfer"))
    bytes_ = AGREEMENT_SLOTS * size * 8
    return f"| {size} | {' | '.join(cells)} | {ratios} | {bytes_} |"


def main(argv: List[str]) -> None:
    del argv
    if FLAGS.rank is not None:
        run_worker(FLAGS.rank, FLAGS.out)
        return
    sizes = sorted(int(k) for k in FLAGS.workers)
    if sizes[0] < 2:
        raise app.UsageError(f"--workers={','.join(FLAGS.workers)}: every world size must be at least 2")
    rows, base = [], None
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="tf_elastic-bench-world-") as directory:
            began = time.monotonic()
            ranks = measure(size, Path(directory))
        worst = {key: max(r[key] for r in ranks) for key in ("import", "strategy", "first", "agree", "transfer")}
        base = base or worst
        rows.append(_row(size, worst, base))
        print(f"measured {size} workers in {time.monotonic() - began:.0f} s", flush=True)
    print(f"\nWorker-side cost of a round at K workers on loopback ({os.cpu_count()} cores; slowest rank; "
          f"ratios to K = {sizes[0]})\n")
    print("| K | TF import s | strategy s | first all-reduce s | agreement ms | 16 MiB all-reduce s "
          "| ratios: strategy / first / agreement / 16 MiB | agreement vector bytes |\n"
          "|---:|---:|---:|---:|---:|---:|---|---:|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    app.run(main)
