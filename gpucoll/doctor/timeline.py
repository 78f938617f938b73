"""Every rank's recorded calls as one Chrome trace (Trace Event Format), for Perfetto or
chrome://tracing: a row per rank, a slice per call from its start to its end.

Each rank is a process (``rank R``, in job-rank order) and each communicator it belongs to a
thread of it, so a job with one communicator has one row per rank. A call still running when
the record was taken lasts until then; a failed call says so in its name and arguments, and
the error is an instant event at the moment it was raised. Times are microseconds from the
earliest call in the trace.
"""

from __future__ import annotations

from typing import Any

from gpucoll.doctor.records import Evidence

_ARGS = ("seq", "dtype", "count", "root", "op", "peer", "stream", "state")


def chrome_trace(evidence: Evidence) -> dict[str, Any]:
    """The trace as a JSON-ready dict (``{"traceEvents": [...], ...}``)."""
    records = [rec for g in evidence.groups.values() for rec in g.ranks.values()]
    starts = [c["started"] for rec in records for c in rec.calls if c.get("started")]
    origin = min(starts) if starts else 0.0
    groups = sorted({rec.group for rec in records}, key=lambda g: (g.count("/"), g))
    events: list[dict[str, Any]] = []
    for family in sorted({rec.family for rec in records}):
        events.append({"ph": "M", "name": "process_name", "pid": family, "tid": 0,
                       "args": {"name": f"rank {family}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": family, "tid": 0,
                       "args": {"sort_index": family}})
    for rec in records:
        tid = groups.index(rec.group)
        events.append({"ph": "M", "name": "thread_name", "pid": rec.family, "tid": tid,
                       "args": {"name": f"{rec.group} (rank {rec.rank} of {rec.size})"}})
        for call in rec.calls:
            slice_ = _slice(call, rec.taken, origin)
            if slice_ is not None:
                events.append({**slice_, "pid": rec.family, "tid": tid})
        if rec.error and rec.error.get("time"):
            events.append({"ph": "i", "s": "t", "name": f"{rec.error['type']}",
                           "ts": round(rec.error["time"] - origin, 1), "pid": rec.family,
                           "tid": tid, "args": {"message": rec.error.get("message", "")}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": evidence.source, "origin_us_since_epoch": origin}}


def _slice(call: dict[str, Any], taken: float, origin: float) -> dict[str, Any] | None:
    start = call.get("started")
    if not start:
        return None
    end = call.get("ended") or taken or start
    seq = call.get("seq", -1)
    if seq >= 0:
        name = f"{call['call']} #{seq}"
    else:
        name = f"{call['call']} {'to' if call['call'] == 'send' else 'from'} {call.get('peer')}"
    if call.get("state") == "failed":
        name += " (failed)"
    args = {k: call[k] for k in _ARGS if call.get(k) is not None}
    if call.get("queued") and call["queued"] < start:
        args["queued_us_before_start"] = round(start - call["queued"], 1)
    return {"ph": "X", "name": name, "cat": call["call"], "ts": round(start - origin, 1),
            "dur": round(max(end - start, 0.0), 1), "args": args}
