"""Rendezvous and membership at N hosts: N simulated agents (the agent's own rendezvous and monitoring code,
no workers, `tf_elastic.testing.rendezvous_sim`, spread over `--processes`) against a real etcd and the
file store.

For each store and N it measures, in this order: N hosts started at once until all train in one round;
steady state; one host lost (it stops renewing, as after SIGKILL) until the rest train in a new round;
one graceful leave; one host joining. Requests are counted at the clients (every HTTP request to etcd,
watch streams included; every file-store operation). It prints a markdown table, then the targets at
the largest N on etcd.

    python -m launch.bench.bench_rendezvous --agents=8,64,256,1024 --host_ttl=10
"""
import os
import tempfile
import time
import uuid
from typing import Dict, List

from absl import app, flags

from tf_elastic.elastic import proc
from tf_elastic.elastic.agent.round import Timeouts
from tf_elastic.elastic.flag_checks import require_finite_floats
from tf_elastic.testing.etcd_server import EtcdServer
from tf_elastic.testing.rendezvous_sim import Simulation

flags.DEFINE_list("agents", ["8", "64", "256", "1024"], "Numbers of simulated hosts (agents), one job each.")
flags.DEFINE_list("stores", ["etcd", "file"], "Stores to measure: etcd (a throwaway etcd-server) and file.")
flags.DEFINE_integer("file_max_agents", 256, "Largest N measured on the file store (one directory, one lock).",
                     lower_bound=1)
flags.DEFINE_float("host_ttl", 10.0, "The hosts' lease TTL in seconds (--host_ttl of the agent).", lower_bound=1.0)
flags.DEFINE_float("last_call", 2.0, "The agent's --last_call.", lower_bound=0.0)
flags.DEFINE_float("monitor_interval", 0.2, "The agent's --monitor_interval.", lower_bound=0.01)
flags.DEFINE_float("steady_seconds", 10.0, "Seconds of steady state measured per N.", lower_bound=1.0)
flags.DEFINE_integer("processes", 4, "Processes the simulated hosts are spread over (each has an interpreter "
                     "lock of its own).", lower_bound=1)
flags.DEFINE_float("phase_timeout", 300.0, "Seconds a phase may take before the run fails.", lower_bound=1.0)
FLAGS = flags.FLAGS
require_finite_floats(__name__)

PHASES = ("start", "loss", "leave", "join")
# Requests that are not the round's: lease renewals (every third of the TTL, whatever happens) and what an
# agent does once when it starts (its lease, the job token).
NOT_THE_ROUNDS = {"lease keepalive", "lease check", "lease grant", "get token", "cas token"}


def _phase(sim: Simulation, result: Dict, name: str, hosts: List, after: int, act, etcd_pid: int) -> int:
    """Runs `act`, then waits until `hosts` train together in a new round; records the seconds from `act`
    to the last host's ranks, the requests meanwhile (by kind), the rounds it took and why they began, and
    the simulator's and etcd's CPU seconds."""
    kinds = sim.requests.snapshot()
    cpu, etcd, began = sim.cpu_seconds(), etcd_pid and proc.cpu_seconds(etcd_pid), time.monotonic()
    act()
    number = sim.wait_ranked(hosts, after, FLAGS.phase_timeout)
    seconds = sim.ranked_at(hosts, number) - began
    kinds = sim.requests.snapshot() - kinds  # one poll of the children: both counts cover the same window
    result[name] = {"seconds": seconds, "requests": sum(kinds.values()),
                    "own": sum(count for kind, count in kinds.items() if kind not in NOT_THE_ROUNDS),
                    "rounds": number - max(after, -1), "sim_cpu": sim.cpu_seconds() - cpu,
                    "etcd_cpu": proc.cpu_seconds(etcd_pid) - etcd if etcd_pid else None,
                    "wall": time.monotonic() - began}
    by_kind = ", ".join(f"{kind} {count / len(hosts):.2f}" for kind, count in kinds.most_common())
    why = "; ".join(sorted({r[2] for h in hosts for n, r in h.rounds.items() if n > after}))
    print(f"  {len(hosts)} hosts, {name}: {seconds:.2f} s, {result[name]['requests']} requests, "
          f"{result[name]['rounds']} round(s) ({why}); CPU s: simulator {result[name]['sim_cpu']:.1f}, etcd "
          f"{result[name]['etcd_cpu'] or 0:.1f}; requests per host: {by_kind}", flush=True)
    return number


def measure(url: str, n: int, etcd_pid: int = 0) -> Dict:
    timeouts = Timeouts(rendezvous=FLAGS.phase_timeout, last_call=FLAGS.last_call, survivor_wait=30.0,
                        host_ttl=FLAGS.host_ttl, poll=0.1)
    sim = Simulation(url, f"bench-{uuid.uuid4().hex[:8]}", min_workers=max(1, n - 2), max_workers=n,
                     timeouts=timeouts, monitor_interval=FLAGS.monitor_interval,
                     processes=min(n, FLAGS.processes))
    result: Dict = {"n": n}
    etcd_cpu, sim_cpu, began = etcd_pid and proc.cpu_seconds(etcd_pid), sim.cpu_seconds(), time.monotonic()
    result.update(dict.fromkeys(PHASES), steady=None)  # None: not measured (a phase before it failed)
    try:
        hosts: List = []
        number = _phase(sim, result, "start", hosts, -1, lambda: hosts.extend(sim.start_hosts(n)), etcd_pid)
        time.sleep(FLAGS.host_ttl / 3)  # the first renewals and watches of the round settle
        requests = sim.requests.total
        time.sleep(FLAGS.steady_seconds)
        result["steady"] = (sim.requests.total - requests) / (n * FLAGS.steady_seconds)
        victim, leaver = hosts[-1], hosts[-2]
        number = _phase(sim, result, "loss", hosts[:-1], number, victim.lose, etcd_pid)
        number = _phase(sim, result, "leave", hosts[:-2], number, leaver.leave, etcd_pid)
        joined: List = hosts[:-2]
        _phase(sim, result, "join", joined, number, lambda: joined.extend(sim.start_hosts(1)), etcd_pid)
    except (TimeoutError, RuntimeError) as error:  # a phase timed out, or a host failed: said below the table
        newest = max((max(rounds, default=-1) for rounds in sim.rounds.values()), default=-1)
        result["failed"] = f"{error}; rounds any host got ranks in: {newest + 1}"
        print(f"  {n} hosts: {result['failed']}", flush=True)
    finally:
        result["sim_cpu"] = sim.cpu_seconds() - sim_cpu  # before the children end
        sim.stop()
    result["etcd_cpu"] = proc.cpu_seconds(etcd_pid) - etcd_cpu if etcd_pid else None
    result["wall"] = time.monotonic() - began
    return result


def _row(store: str, r: Dict) -> str:
    n, measured = r["n"], [p for p in PHASES if r[p]]
    seconds = " | ".join("not measured" if not r[p] else f"{r[p]['seconds']:.2f}" + (
        f" ({r[p]['rounds']} rounds)" if r[p]["rounds"] > 1 else "") for p in PHASES)
    per_n = " / ".join(f"{r[p]['requests'] / n:.1f} ({r[p]['own'] / n:.1f})" if r[p] else "-" for p in PHASES)
    share = " / ".join("-" if not r[p] else f"{r[p]['sim_cpu']:.1f}" + (
        f"+{r[p]['etcd_cpu']:.1f}" if r[p]["etcd_cpu"] is not None else "") for p in PHASES)
    etcd = "-" if r["etcd_cpu"] is None else f"{r['etcd_cpu']:.1f}"
    steady = "-" if r["steady"] is None else f"{r['steady']:.2f}"
    return (f"| {store} | {n} | {seconds} | {per_n} | {steady} | {etcd} | {r['sim_cpu']:.1f} | {share} "
            f"| {r['wall']:.0f} |") if measured or r.get("failed") else ""


def _targets(r: Dict) -> List[str]:
    n, ttl = r["n"], FLAGS.host_ttl
    checks = [
        ("join", "last host's join to its frozen round <= 3 s", 3.0),
        ("start", f"{n} hosts started at once to their frozen round <= 3 s", 3.0),
        ("loss", f"host lost to the next frozen round <= TTL + 3 s = {ttl + 3:g} s", ttl + 3),
        ("leave", "graceful leave to the next frozen round <= 3 s", 3.0),
    ]
    lines = [f"{what}: " + (f"{r[phase]['seconds']:.2f} s ({'met' if r[phase]['seconds'] <= bound else 'NOT met'})"
                            if r[phase] else "not measured (NOT met)") for phase, what, bound in checks]
    for phase in (p for p in PHASES if r[p]):
        every, own = (r[phase][k] / r[phase]["rounds"] for k in ("requests", "own"))
        lines.append(f"requests per round ({phase}) <= 4 N = {4 * n}: the round's own {own:.0f} "
                     f"({'met' if own <= 4 * n else 'NOT met'}); with renewals and start-up {every:.0f} "
                     f"({'met' if every <= 4 * n else 'NOT met'})")
    if r["steady"] is not None:
        lines.append(f"steady state <= 1 request per agent-second: {r['steady']:.2f} "
                     f"({'met' if r['steady'] <= 1 else 'NOT met'})")
    return lines


def main(argv: List[str]) -> None:
    del argv
    sizes = sorted(int(n) for n in FLAGS.agents)
    rows, largest = [], None
    if "etcd" in FLAGS.stores:
        server = EtcdServer(election_timeout_ms=1000).start()
        try:
            for n in sizes:
                result = measure(server.url, n, server.process.pid)
                rows.append(("etcd", result))
                largest = result
                print(f"measured etcd at {n} hosts in {result['wall']:.0f} s", flush=True)
        finally:
            server.close()
    if "file" in FLAGS.stores:
        with tempfile.TemporaryDirectory(prefix="tf_elastic-bench-rdzv-") as directory:
            for n in (s for s in sizes if s <= FLAGS.file_max_agents):
                rows.append(("file", measure(f"file://{directory}/n{n}", n)))
                print(f"measured the file store at {n} hosts", flush=True)
    print(f"\nRendezvous at N hosts (host TTL {FLAGS.host_ttl:g} s, last call {FLAGS.last_call:g} s, "
          f"{os.cpu_count()} cores; the simulator shares them with etcd)\n")
    print("| store | N | start s | loss s | leave s | join s | requests ÷ N, all (the round's own), start / loss / "
          "leave / join | steady requests per agent-s | etcd CPU s | simulator CPU s | CPU s simulator+etcd, "
          "per phase | wall s |\n|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|")
    for store, result in rows:
        print(_row(store, result))
    print(f"\nThe round's own requests: all but {', '.join(sorted(NOT_THE_ROUNDS))}.")
    for store, result in rows:
        if result.get("failed"):
            print(f"\n{store} at {result['n']} hosts: {result['failed']}")
    if largest is not None:
        print(f"\nTargets at {largest['n']} hosts on etcd:")
        for line in _targets(largest):
            print(f"- {line}")


if __name__ == "__main__":
    app.run(main)
