"""What a job is doing, read from its store (and its events where a run dir is readable), without TensorFlow:
the outcome, the current round and its members with ranks and addresses (and which are stragglers),
standbys, blacklisted hosts and the time they have left, hosts evicted as stragglers, the last commit and
its age, recent steps per second. `launch/status.py`
(`tf-elastic-status`) prints it, once or every few seconds.
"""
import dataclasses
import json
import time
from typing import Dict, List, Optional, Sequence, Tuple

from tf_elastic.elastic.agent.job_record import JobKeys, JobRecord
from tf_elastic.elastic.agent.round import Phase, Round, is_finite_number
from tf_elastic.elastic.events import read_events, straggler_key
from tf_elastic.elastic.protocol import Event
from tf_elastic.elastic.store import Store

RECENT_COMMITS = 5  # steps per second are measured over the newest this many commits


@dataclasses.dataclass
class Member:
    host: str
    ranks: List[int]
    addresses: List[str]


@dataclasses.dataclass
class JobStatusView:
    job_id: str
    outcome: Optional[str]  # "done: reason", "failed: reason", None while the job runs
    round_: Optional[Round]
    members: List[Member]
    standbys: List[str]  # leased hosts outside a frozen round (a standby, or a host about to open the next)
    blacklisted: Dict[str, float]  # host -> seconds left
    joining: List[str] = dataclasses.field(default_factory=list)  # leased hosts while the round is joining
    last_commit: Optional[Dict] = None  # the newest `commit` event, if events were readable
    steps_per_second: Optional[float] = None
    stragglers: Dict[str, str] = dataclasses.field(default_factory=dict)  # host -> how slow, in the current round
    evicted: Dict[str, float] = dataclasses.field(default_factory=dict)  # host -> seconds of its hold-off left


def read_status(store: Store, job_id: str, run_dirs: Sequence[str] = (), now: Optional[float] = None,
                lease_wait: float = 0.0) -> JobStatusView:
    """`lease_wait`: seconds between two reads of the host leases, for a store that times leases on its
    reader's clock (the file store: a fresh reader takes every lease it sees for the first time as new, a
    dead host's too); give the agents' `--host_ttl`."""
    keys, now = JobKeys(job_id), time.time() if now is None else now
    outcome = JobRecord(store, job_id, host_id="").outcome()
    raw = store.get(keys.round)
    round_ = Round.from_json(raw, keys.round) if raw else None
    assignment = (round_.assignment or {}) if round_ else {}
    cluster = (round_.cluster or []) if round_ else []
    members = [Member(host, sorted(ranks), [cluster[r] for r in sorted(ranks) if r < len(cluster)])
               for host, ranks in sorted(assignment.items(), key=lambda item: min(item[1], default=0))]
    if lease_wait:
        store.list(keys.hosts)
        time.sleep(lease_wait)
    leased = [key.rsplit("/", 1)[-1] for key in store.list(keys.hosts)]
    outside = sorted(h for h in leased if h not in assignment)
    joining = round_ is not None and round_.phase == Phase.JOINING.value  # every leased host is joining it
    view = JobStatusView(job_id, f"{outcome.status.value}: {outcome.reason}" if outcome else None, round_, members,
                         [] if joining else outside, _blacklisted(store, job_id, now),
                         joining=outside if joining else [])
    events = read_events(list(run_dirs)) if run_dirs else []
    commits = [e for e in events if e["event"] == Event.COMMIT]
    view.stragglers, view.evicted = _stragglers(events, round_.number if round_ else None, now)
    if commits:
        view.last_commit = commits[-1]
        recent = commits[-RECENT_COMMITS:]
        if len(recent) > 1 and recent[-1]["time"] > recent[0]["time"]:
            view.steps_per_second = (recent[-1]["step"] - recent[0]["step"]) / (recent[-1]["time"] - recent[0]["time"])
    return view


def _stragglers(events: List[Dict], round_: Optional[int], now: float) -> Tuple[Dict[str, str], Dict[str, float]]:
    """The hosts whose workers are stragglers in `round_` (their agents' `straggler` events not followed by a
    recovery), and the evicted hosts still sitting out a hold-off."""
    slow: Dict[Tuple[str, int, str], str] = {}
    for e in events:
        key = straggler_key(e)
        if e["event"] == Event.STRAGGLER and e.get("round") == round_:
            slow[key] = f"rank {e['rank']} {e['slowness']:.2f}x ({e['cause']})"
        elif e["event"] == Event.STRAGGLER_RECOVERED and e.get("round") == round_:
            slow.pop(key, None)
    hosts: Dict[str, str] = {}
    for (host, _, _), text in sorted(slow.items()):
        hosts[host] = f"{hosts[host]}, {text}" if host in hosts else text
    # An eviction starts a hold-off; a probation's timing that found the host still slow, the wait for the next
    # (`--probation_interval`; one that found it back, none).
    evicted = {e["host"]: e["time"] + e["hold_off"] - now for e in events
               if e["event"] in (Event.EVICTED, Event.PROBATION)}
    return hosts, {host: left for host, left in evicted.items() if left > 0}


def _blacklisted(store: Store, job_id: str, now: float) -> Dict[str, float]:
    out = {}
    for key, raw in store.list(JobKeys(job_id).blacklist("")).items():
        try:
            until = json.loads(raw).get("until")
        except (ValueError, AttributeError):
            continue  # a malformed record: the agents refuse it, the status shows what it can
        if is_finite_number(until) and until > now:
            out[key.rsplit("/", 1)[-1]] = until - now
    return out


def render(view: JobStatusView, now: Optional[float] = None) -> str:
    now = time.time() if now is None else now
    r = view.round_
    state = view.outcome or ("running" if r else "no round yet")
    lines = [f"job {view.job_id}: {state}"]
    if r:
        lines.append(f"round {r.number} ({r.phase}), world size {r.world_size}, restarts {r.restarts}; "
                     f"opened {now - r.opened:.0f} s ago because: {r.why}")
    lines += ["| host | ranks | addresses | straggler |", "|---|---|---|---|"]
    lines += [f"| {m.host} | {','.join(map(str, m.ranks))} | {' '.join(m.addresses)} | "
              f"{view.stragglers.get(m.host, '-')} |" for m in view.members]
    if view.joining:
        lines.append("joining: " + ", ".join(view.joining))
    lines.append("standby: " + (", ".join(view.standbys) or "none"))
    lines.append("blacklisted: " + (", ".join(f"{h} ({s:.0f} s left)" for h, s in sorted(view.blacklisted.items()))
                                    or "none"))
    if view.evicted:
        lines.append("evicted as stragglers: " + ", ".join(f"{h} (may rejoin in {s:.0f} s)"
                                                            for h, s in sorted(view.evicted.items())))
    if view.last_commit:
        c = view.last_commit
        rate = f"; {view.steps_per_second:.2f} steps/s over the last commits" if view.steps_per_second else ""
        lines.append(f"last commit: step {c['step']} (epoch {c['epoch']}), {now - c['time']:.1f} s ago{rate}")
    return "\n".join(lines)
