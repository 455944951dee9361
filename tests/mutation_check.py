"""A mutation check for developers (not run by CI): meaningful small breakages of the optimizer, the
schedule, the data plan and the rendezvous rules, each of which the fast tests must catch.

    python tests/mutation_check.py             # every mutation; prints a table, exits 1 if one survives
    python tests/mutation_check.py --only 3    # one of them

Each mutation is applied to a copy of the checkout (git's tracked files), then the named fast tests run
there; a mutation is killed when they fail. The list names its tests so that each run stays short.
"""
import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]


class Mutation(NamedTuple):
    what: str
    path: str
    old: str
    new: str
    tests: str  # pytest selection, run with -m "not slow"


MUTATIONS = [
    Mutation("commit: dropout's seed state not added to the checkpoint", "tf_elastic/elastic/worker/commit.py",
             '**({"untracked": untracked} if untracked else {})', "",
             "tests/test_commit.py"),
    Mutation("commit: model weights only (BatchNorm statistics, seed states left out)",
             "tf_elastic/elastic/worker/commit.py", "return [*self.model.variables,",
             "return [*self.model.trainable_variables,", "tests/test_commit.py"),
    Mutation("LARS: weight decay left out of the trust ratio's denominator", "tf_elastic/optimizers/lars.py",
             "g_norm + beta * w_norm + self.epsilon", "g_norm + self.epsilon",
             "tests/test_lars.py -k reference"),
    Mutation("LARS: no guard for a zero norm", "tf_elastic/optimizers/lars.py",
             "usable = ops.logical_and(w_norm > 0, g_norm > 0)", "usable = w_norm > -1",
             "tests/test_lars.py -k zero_norm"),
    Mutation("schedule: 4 ramp steps per factor by default", "tf_elastic/schedules/batch_resize.py",
             "ramp_steps_per_factor: float = 8.0", "ramp_steps_per_factor: float = 4.0",
             "tests/test_batch_resize_schedule.py"),
    Mutation("schedule: square-root scaling where linear is asked", "tf_elastic/schedules/batch_resize.py",
             '{"linear": ratio,', '{"linear": math.sqrt(ratio),', "tests/test_batch_resize_schedule.py"),
    Mutation("data plan: the same permutation every epoch", "tf_elastic/elastic/worker/data_plan.py",
             "default_rng([self.seed, epoch])", "default_rng([self.seed, 0])",
             "tests/test_data_plan.py -k data_plan"),
    Mutation("data plan: a replica's slice ignores its rank", "tf_elastic/elastic/worker/data_plan.py",
             "rank * batch: k * global_batch + (rank + 1) * batch", "0: k * global_batch + batch",
             "tests/test_data_plan.py -k data_plan tests/test_data_sources.py"),
    Mutation("rendezvous: newcomers ranked before survivors", "tf_elastic/elastic/agent/decisions.py",
             'key=lambda item: (item[1]["previous_rank"] is None,', 'key=lambda item: (item[1]["joined"],',
             "tests/test_decisions.py tests/test_rendezvous.py -k 'survivors or freeze'"),
    Mutation("rendezvous: a full round does not wait for its survivors", "tf_elastic/elastic/agent/decisions.py",
             "    if missing:\n        return waited > timeouts.survivor_wait",
             "    if missing and joined < max_workers:\n        return waited > timeouts.survivor_wait",
             "tests/test_decisions.py"),
    Mutation("rendezvous: a host in a full round opens the next one", "tf_elastic/elastic/agent/decisions.py",
             "return JoinAction.STANDBY", "return JoinAction.OPEN_NEXT", "tests/test_decisions.py"),
    Mutation("agent: a silent heartbeat is not a hang", "tf_elastic/elastic/agent/decisions.py",
             "for kind, ranks in ((Failure.HANG, silent), (Failure.NO_PROGRESS, stalled)):",
             "for kind, ranks in ((Failure.NO_PROGRESS, stalled),):", "tests/test_decisions.py"),
    Mutation("job record: any token is accepted", "tf_elastic/elastic/agent/job_record.py",
             "if not self._token_checked:\n            raise TokenRefused", "if False:\n            raise TokenRefused",
             "tests/test_rendezvous.py -k token"),
    Mutation("file store: leases never expire", "tf_elastic/elastic/store/file.py",
             "self._unchanged_for(path, record[\"version\"]) > ttl", "False",
             "tests/test_store.py -k clock tests/test_rendezvous.py -k 'leases and file'"),
]


def run(mutation: Mutation) -> tuple:
    with tempfile.TemporaryDirectory(prefix="tf_elastic-mutant-") as tmp:
        copy = Path(tmp) / "repo"
        files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        for name in files.splitlines():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
        target = copy / mutation.path
        source = target.read_text()
        if mutation.old not in source:
            return "not applied (the code moved: update the mutation)", 0.0
        target.write_text(source.replace(mutation.old, mutation.new, 1))
        started = time.monotonic()
        proc = subprocess.run(f"{sys.executable} -m pytest -q -x -n 0 -p no:cacheprovider -m 'not slow' "
                              f"{mutation.tests}",
                              shell=True, cwd=copy, capture_output=True, text=True)
        seconds = time.monotonic() - started
        if proc.returncode == 1:
            return "killed", seconds
        if proc.returncode == 0:
            return "SURVIVED", seconds
        return f"error (pytest exit {proc.returncode})", seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, help="run mutation N only (1-based)")
    args = parser.parse_args()
    chosen = list(enumerate(MUTATIONS, 1))
    if args.only:
        chosen = [chosen[args.only - 1]]
    print("| # | mutation | killed by | result | seconds |\n|---:|---|---|---|---:|")
    survived = 0
    for number, mutation in chosen:
        result, seconds = run(mutation)
        survived += result != "killed"
        print(f"| {number} | {mutation.what} | `{mutation.tests}` | {result} | {seconds:.0f} |", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
